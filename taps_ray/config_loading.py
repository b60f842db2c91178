"""Reading configuration files: a YAML document, dotted overrides (``a.b.c=value``, the value parsed
as YAML) and a pydantic ``ValidationError`` told as one line per problem, each naming its dotted key.
Experiment configs (:mod:`taps_ray.config`) and sweep specs (:mod:`taps_ray.sweeps.config`) load
through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names key, value and rule."""


def format_validation_error(err: ValidationError, model: type[BaseModel], title: str) -> str:
    """One line per problem of ``err`` (raised validating ``model``), under ``title``: the dotted key,
    the message and the value given; an unknown key lists the keys allowed there. Used for experiment
    configs and sweep specs alike."""
    lines = []
    for item in err.errors():
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        key = ".".join(str(p) for p in loc)
        msg = item["msg"].removeprefix("Value error, ")
        got = item.get("input")
        if item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key; allowed keys: {_allowed(model, loc[:-1])} (got {got!r})")
        elif item["type"] == "missing":
            lines.append(f"{key}: required key is missing")
        elif not key:
            lines.append(msg)
        else:
            lines.append(f"{key}: {msg}" if isinstance(got, dict | list) else f"{key}: {msg} (got {got!r})")
    body = f" {lines[0]}" if len(lines) == 1 else "\n  " + "\n  ".join(lines)
    return f"{title}:{body}"


def _allowed(model: Any, loc: tuple) -> str:
    """The keys of the model at ``loc`` below ``model`` (parts that are not fields, such as the names
    of a dict's entries, are passed over)."""
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return "?"
        if part in model.model_fields:
            model = _inner_model(model.model_fields[part].annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return ", ".join(model.model_fields)
    return "?"


def _inner_model(annotation: Any) -> Any:
    args = getattr(annotation, "__args__", None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in args or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def load_yaml(path: str | Path, what: str = "config file", error: type[Exception] = ConfigError) -> Any:
    """The YAML document of ``path`` (``{}`` when empty); ``error`` naming the file when it is missing or
    not valid YAML."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {str(path)!r} does not exist")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise error(f"{path}: not valid YAML: {err}") from None


_Section = TypeVar("_Section", bound=BaseModel)


def check_section(section: str, given: dict[str, Any], model: type[_Section], base: dict[str, Any]) -> _Section:
    """Validate ``base`` updated with ``given`` as ``model`` (a section and overrides of its keys); ValueError
    naming ``section.key`` for an unknown key or a bad value."""
    unknown = sorted(set(given) - set(model.model_fields))
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; allowed keys: {', '.join(model.model_fields)}")
    try:
        return model.model_validate({**base, **given})
    except ValidationError as err:
        item = err.errors()[0]
        key = ".".join(str(p) for p in item["loc"])
        raise ValueError(f"{section}.{key}: {item['msg']} (got {item.get('input')!r})") from None
