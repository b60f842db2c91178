"""The configuration reference, read from the pydantic models themselves: every dotted key of the
experiment config (:class:`~taps_ray.config.ExperimentConfig`) and of sweep specs
(:mod:`taps_ray.sweeps.config`) with its type, default and the field's ``description``.

``taps config-help`` prints it (``--markdown``: docs/CONFIG.md, which a test keeps equal to this
output). Keys inside a mapping are written ``<name>`` (``data.datasets.<name>.domain``), inside a
list ``[]`` (``variants[].name``). Light: pydantic and the config modules only, no torch.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Key:
    """One documented key: ``section`` is True for a nested model, whose own keys follow it."""

    key: str
    type: str
    default: str
    description: str
    section: bool = False


def type_name(annotation: Any) -> str:
    """A short readable name of a field's type (``int | None``, ``auto | float32``, ``dict[str, SourceSpec]``)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(type_name(a) for a in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _nested(annotation: Any, path: str = "") -> tuple[type[BaseModel], str] | None:
    """The model a field holds and the key suffix that reaches it: ``""`` (the model itself or optional),
    ``.<name>`` (a mapping's values) or ``[]`` (a list's items)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, path
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _nested(args[0], path)
    if origin is Union or origin is types.UnionType:
        for arg in args:
            found = _nested(arg, path)
            if found:
                return found
    if origin is dict and args:
        return _nested(args[1], f"{path}.<name>")
    if origin is list and args:
        return _nested(args[0], f"{path}[]")
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def default_text(field: FieldInfo) -> str:
    """The field's default as JSON (``required`` when it has none; empty for a section)."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return json.dumps(_plain(value))


def model_keys(model: type[BaseModel], prefix: str = "", skip: tuple[str, ...] = ()) -> Iterator[Key]:
    """Every key of ``model`` and of the models nested in it, depth first, in field order."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        key = f"{prefix}{name}"
        nested = _nested(field.annotation)
        yield Key(key, type_name(field.annotation), default_text(field), field.description or "", nested is not None)
        if nested is not None:
            inner, suffix = nested
            yield from model_keys(inner, f"{key}{suffix}.")


def documents() -> list[tuple[str, str, list[Key]]]:
    """``(title, introduction, keys)`` of each part of the reference, in order."""
    from taps_ray.config import ExperimentConfig, ObjectiveConfig
    from taps_ray.sweeps.config import InterpolationSweepSpec, MixtureSweepSpec, SweepSpec

    shared = tuple(SweepSpec.model_fields)
    experiment = list(model_keys(ExperimentConfig))
    # A variant's objective is a dict of ObjectiveConfig keys (the algorithm is the variant's own).
    at = next(i for i, k in enumerate(experiment) if k.key == "variants[].objective") + 1
    experiment[at:at] = model_keys(ObjectiveConfig, "variants[].objective.", skip=("algorithm",))
    return [
        ("Experiment config (`configs/*.yaml`)",
         "What a `taps` command's CONFIG argument names. Any key can be overridden on the command "
         "line with its dotted path, e.g. `taps train configs/demo.yaml train.epochs=3 "
         "data.features.max_len=512` (values are parsed as YAML).",
         experiment),
        ("Sweep specs (`tune/*.yaml`): keys of both kinds",
         "`taps sweep SPEC [CONFIG] [--preset NAME] [key=value ...]`; dotted overrides apply to the spec.",
         list(model_keys(SweepSpec))),
        ("Sweep specs: `kind: mixture`",
         "Search keys: `ratio`, `total`, `algorithm`, `train.KEY`, `objective.KEY`.",
         list(model_keys(MixtureSweepSpec, skip=shared))),
        ("Sweep specs: `kind: interpolation`",
         "Search keys: `alpha` (two drafters) or `weights` (one weight per drafter, summing to 1).",
         list(model_keys(InterpolationSweepSpec, skip=shared))),
    ]


def select(keys: list[Key], prefix: str | None) -> list[Key]:
    """The keys at or under dotted key ``prefix`` (all when None)."""
    if not prefix:
        return keys
    return [k for k in keys if k.key == prefix or k.key.startswith((f"{prefix}.", f"{prefix}[]"))]


def render_text(keys: list[Key]) -> str:
    """One entry per key: ``key: type = default`` and the description indented below it."""
    lines = []
    for k in keys:
        head = f"{k.key}: {k.type}" + (f" = {k.default}" if k.default else "")
        lines += [head, f"    {k.description}"]
    return "\n".join(lines) + "\n"


def _pipes(text: str) -> str:
    return text.replace("|", "\\|")


def _cell(text: str) -> str:
    """Description text in a table cell: pipes escaped, ``<`` written so that ``<name>`` is not a tag."""
    return _pipes(text).replace("<", "&lt;")


def render_markdown() -> str:
    """The whole reference as Markdown: docs/CONFIG.md."""
    out = ["# Configuration reference", "",
           "Generated from the field descriptions in `taps_ray/config.py` and `taps_ray/sweeps/config.py` by",
           "`taps config-help --markdown > docs/CONFIG.md`; do not edit it by hand (tests/test_config.py fails",
           "when it is out of date). `taps config-help [KEY]` prints the same keys on the console.",
           "Keys inside a mapping are written `<name>`, inside a list `[]`; a row whose type is a section",
           "(a name such as `TargetConfig`) is followed by that section's keys."]
    for title, intro, keys in documents():
        out += ["", f"## {title}", "", intro, "", "| key | type | default | description |", "|---|---|---|---|"]
        for k in keys:
            default = k.default if k.default in ("", "required") else f"`{_pipes(k.default)}`"
            out.append(f"| `{k.key}` | `{_pipes(k.type)}` | {default} | {_cell(k.description)} |")
    return "\n".join(out) + "\n"
