"""Sweep specs (``tune/*.yaml``) consumed by ``taps sweep``.

A spec is YAML with ``kind: mixture`` (train one drafter per data mixture) or ``kind: interpolation``
(average two or more trained drafters in weight space). Every section is a pydantic model with
``extra="forbid"``; a bad spec is a :class:`SweepSpecError` whose lines name the dotted key.

Search dimensions (``search:``) take one of ``grid: [..]`` (a plain list is a grid), ``choice:
[..]``, ``uniform: [lo, hi]``, ``loguniform: [lo, hi]`` or ``randint: [lo, hi)``; grid values are
crossed, the others are sampled ``num_samples`` times (Ray Tune's basic variant generator).
``presets`` are partial specs merged over the spec by ``--preset NAME`` (a null removes a key).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from taps_ray.config import (
    ConfigError,
    ObjectiveConfig,
    Strict,
    TrainConfig,
    TreeConfig,
    apply_overrides,
    format_validation_error,
    load_yaml,
)
from taps_ray.data.benchmarks import BENCHMARKS

RATIO_KEYS = ("ratio", "total", "algorithm")
SEARCHABLE_TRAIN = ("epochs", "batch_size", "lr", "warmup_steps", "schedule", "weight_decay", "grad_clip",
                    "max_tokens", "seed", "stage2")
SEARCHABLE_OBJECTIVE = tuple(k for k in ObjectiveConfig.model_fields if k != "algorithm")
PROMPT_SOURCES = ("heldout", *BENCHMARKS)


class SweepSpecError(ConfigError):
    """A sweep spec is invalid; each line names the dotted key, the value and the rule."""


class Dimension(Strict):
    """One search dimension: exactly one of ``grid``, ``choice``, ``uniform``, ``loguniform``, ``randint``."""

    grid: list[Any] | None = None
    choice: list[Any] | None = None
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    randint: tuple[int, int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _list_is_grid(cls, value: Any) -> Any:
        return {"grid": value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _one_kind(self) -> Dimension:
        given = [k for k in type(self).model_fields if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(type(self).model_fields)}, got {given or 'none'}")
        kind = given[0]
        if kind in ("grid", "choice") and not getattr(self, kind):
            raise ValueError(f"{kind} is empty: the search space needs at least one value")
        if kind in ("uniform", "loguniform", "randint"):
            lo, hi = getattr(self, kind)
            if not lo < hi:
                raise ValueError(f"{kind} needs lo < hi, got [{lo}, {hi}]")
            if kind == "loguniform" and lo <= 0:
                raise ValueError(f"loguniform needs lo > 0, got {lo}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)

    @property
    def finite(self) -> list[Any] | None:
        """The values of a ``grid`` or ``choice``; None for sampled ranges."""
        return self.grid if self.grid is not None else self.choice

    def probes(self) -> list[Any]:
        """Values that stand for the dimension in validation: every finite value, or a range's ends
        (``randint`` excludes its upper end)."""
        if self.finite is not None:
            return list(self.finite)
        lo, hi = getattr(self, self.kind)
        return [lo, hi - 1] if self.kind == "randint" else [lo, hi]

    def numeric_bounds(self) -> tuple[float, float] | None:
        values = self.probes()
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            return min(values), max(values)
        return None

    def to_tune(self):
        from ray import tune

        kind = self.kind
        if kind == "grid":
            return tune.grid_search(list(self.grid))
        if kind == "choice":
            return tune.choice(list(self.choice))
        return getattr(tune, kind)(*getattr(self, kind))


class ObjectiveSpec(Strict):
    """What a sweep maximises: ``mean`` tau over domains, the ``worst`` domain's tau, or one ``domain``'s.

    Shorthand: ``mean``, ``worst`` or ``domain:NAME``.
    """

    kind: Literal["mean", "worst", "domain"] = "mean"
    domain: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            kind, _, domain = value.partition(":")
            return {"kind": kind, "domain": domain or None}
        return value

    @model_validator(mode="after")
    def _domain(self) -> ObjectiveSpec:
        if (self.kind == "domain") != (self.domain is not None):
            raise ValueError("objective 'domain' needs a domain name (domain:NAME); 'mean' and 'worst' take none")
        return self

    def value(self, taus: dict[str, float]) -> float:
        """The objective of per-domain ``taus`` (NaN when a needed domain is missing)."""
        if self.kind == "domain":
            return float(taus.get(self.domain, math.nan))
        values = list(taus.values())
        if not values or any(math.isnan(v) for v in values):
            return math.nan
        return sum(values) / len(values) if self.kind == "mean" else min(values)

    def describe(self) -> str:
        return {"mean": "mean tau over domains", "worst": "worst-domain tau"}.get(self.kind, f"tau on {self.domain}")


class PromptSpec(Strict):
    """Held-out prompts of one domain.

    ``source``: ``heldout`` (the user turn before the first assistant token of the held-out rows of
    feature set ``dataset``: the seeded split of ``train.heldout_rows`` that no drafter trains on) or a
    benchmark (``mt_bench``, ``gsm8k``, ``math_500``, ``svamp``; its first turns). ``dataset`` (default:
    the domain's name) is also the feature set whose held-out simulated tau stands for the domain
    during mixture training. ``limit`` prompts, chosen by ``seed``.
    """

    source: str = "heldout"
    dataset: str | None = None
    limit: int = Field(default=8, ge=1)
    seed: int = 0

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if value not in PROMPT_SOURCES:
            raise ValueError(f"unknown prompt source {value!r}; valid: {', '.join(PROMPT_SOURCES)}")
        return value


class EvalSpec(Strict):
    """How a trial's drafter is scored: greedy speculative decoding of ``max_new_tokens`` after each
    prompt with the core decoder (the experiment's ``tree``, or ``tree`` here); tau per domain is the
    micro average over its prompts (appended tokens / steps)."""

    prompts: dict[str, PromptSpec] = Field(min_length=1)
    max_new_tokens: int = Field(default=64, ge=1)
    tree: TreeConfig | None = None

    @field_validator("prompts", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: {"source": v} if isinstance(v, str) else v for k, v in value.items()}
        return value


class ResourcesSpec(Strict):
    """Resources of one trial.

    A mixture trial is a light Tune actor (``trial_cpus``) that drives a Ray Train run of
    ``num_workers`` workers (``cpus_per_worker`` CPUs each, or 1 CPU + 1 GPU with ``use_gpu``), then a
    Ray task that measures tau (``eval_cpus``, + 1 GPU with ``use_gpu``); ``reserve_cpus`` stay free for
    Ray Data's read tasks. An interpolation trial is one actor of ``eval_cpus`` (+ 1 GPU). ``use_gpu``
    ``auto``: when the cluster has GPUs. ``threads``: torch threads per process (None: its CPUs).
    ``max_concurrent_trials`` (None: as many as the cluster fits).
    """

    num_workers: int = Field(default=1, ge=1)
    cpus_per_worker: float = Field(default=1.0, gt=0)
    use_gpu: bool | Literal["auto"] = "auto"
    eval_cpus: float = Field(default=1.0, gt=0)
    trial_cpus: float = Field(default=0.25, gt=0)
    reserve_cpus: float = Field(default=1.0, ge=0)
    threads: int | None = Field(default=None, ge=1)
    max_concurrent_trials: int | None = Field(default=None, ge=1)


class SchedulerSpec(Strict):
    """Early stopping of mixture trials: ``asha`` compares the simulated objective (the objective over
    the domains' held-out simulated tau) at epochs ``grace_period * reduction_factor**k`` and stops
    the trials below the top ``1 / reduction_factor``; ``none`` runs every trial to the end."""

    kind: Literal["asha", "none"] = "asha"
    grace_period: int = Field(default=1, ge=1)
    reduction_factor: float = Field(default=2.0, gt=1)


class MixtureBase(Strict):
    """The drafter every mixture trial trains, before the trial's search values apply.

    ``datasets``: the two feature sets mixed; ``ratio`` is the share of the first (math:chat =
    ratio:1-ratio) of ``total`` rows (None: as many as the pools allow). ``algorithm``, ``objective``
    and ``train`` are a variant's keys (``train`` over the experiment's ``train`` section).
    """

    datasets: list[str] = Field(min_length=2, max_length=2)
    ratio: float = Field(default=0.5, ge=0.0, le=1.0)
    total: int | None = Field(default=None, ge=1)
    seed: int = 0
    algorithm: Literal["eagle2", "hass"] = "hass"
    objective: dict[str, Any] = Field(default_factory=dict)
    train: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _distinct(self) -> MixtureBase:
        if self.datasets[0] == self.datasets[1]:
            raise ValueError(f"datasets must be two different feature sets, got {self.datasets}")
        return self


class SweepSpec(Strict):
    """Keys shared by both kinds: ``name`` (output folder ``runs/<experiment>/sweeps/<name>``),
    ``experiment`` config, ``num_samples``, ``max_failures`` retries per trial before it is reported
    failed, ``objective``, ``eval``, ``resources``."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    experiment: str = "configs/demo.yaml"
    num_samples: int = Field(default=1, ge=1)
    max_failures: int = Field(default=1, ge=0)
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    eval: EvalSpec
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    search: dict[str, Dimension]
    presets: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("search")
    @classmethod
    def _not_empty(cls, value: dict[str, Dimension]) -> dict[str, Dimension]:
        if not value:
            raise ValueError("the search space is empty: give at least one dimension")
        return value

    @model_validator(mode="after")
    def _objective_domain(self) -> SweepSpec:
        if self.objective.kind == "domain" and self.objective.domain not in self.eval.prompts:
            raise ValueError(f"objective.domain: {self.objective.domain!r} is not a domain of eval.prompts; "
                             f"domains: {sorted(self.eval.prompts)}")
        return self

    @property
    def domains(self) -> list[str]:
        return list(self.eval.prompts)

    def param_space(self) -> dict[str, Any]:
        return {key: dim.to_tune() for key, dim in self.search.items()}


def _check_value(model: type[BaseModel], field: str, value: Any) -> None:
    try:
        model.model_validate({field: value})
    except ValidationError as err:
        raise ValueError(f"{err.errors()[0]['msg'].removeprefix('Value error, ')} (got {value!r})") from None


class MixtureSweepSpec(SweepSpec):
    """``kind: mixture``: search keys ``ratio`` (share of ``mixture.datasets[0]``, in [0, 1]),
    ``total`` (rows), ``algorithm`` (eagle2 | hass), ``train.KEY`` and ``objective.KEY`` (training
    knobs of the variant). Each trial reports its simulated objective per epoch (for ``scheduler``)
    and, at the end, tau per domain on the held-out prompts."""

    kind: Literal["mixture"]
    mixture: MixtureBase
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)

    @model_validator(mode="after")
    def _search_keys(self) -> MixtureSweepSpec:
        allowed = [*RATIO_KEYS, *(f"train.{k}" for k in SEARCHABLE_TRAIN),
                   *(f"objective.{k}" for k in SEARCHABLE_OBJECTIVE)]
        for key, dim in self.search.items():
            if key not in allowed:
                raise ValueError(f"search.{key}: not a searchable key; allowed: ratio, total, algorithm, "
                                 f"train.{{{','.join(SEARCHABLE_TRAIN)}}}, objective.{{{','.join(SEARCHABLE_OBJECTIVE)}}}")
            for value in dim.probes():
                try:
                    _check_mixture_value(key, value)
                except ValueError as err:
                    raise ValueError(f"search.{key}: {err}") from None
        for section, model in (("objective", ObjectiveConfig), ("train", TrainConfig)):
            for key, value in getattr(self.mixture, section).items():
                if key not in model.model_fields or key == "algorithm":
                    raise ValueError(f"mixture.{section}.{key}: unknown key; allowed keys: "
                                     f"{', '.join(k for k in model.model_fields if k != 'algorithm')}")
                try:
                    _check_value(model, key, value)
                except ValueError as err:
                    raise ValueError(f"mixture.{section}.{key}: {err}") from None
        return self

    def max_epochs(self) -> int:
        """The most epochs any trial trains (stage 2 of HASS included), for the scheduler's horizon."""
        dim = self.search.get("train.epochs")
        epochs = max(dim.probes()) if dim else self.mixture.train.get("epochs")
        stage2 = self.mixture.train.get("stage2") or {}
        return int(epochs or TrainConfig().epochs) + int(stage2.get("epochs", 0) if stage2 else 0)


def _check_mixture_value(key: str, value: Any) -> None:
    if key == "ratio":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise ValueError(f"ratio must be a number in [0, 1] (the share of mixture.datasets[0]), got {value!r}")
    elif key == "total":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"total must be an integer >= 1 (rows), got {value!r}")
    elif key == "algorithm":
        if value not in ("eagle2", "hass"):
            raise ValueError(f"algorithm must be eagle2 or hass, got {value!r}")
    else:
        section, field = key.split(".", 1)
        _check_value(TrainConfig if section == "train" else ObjectiveConfig, field, value)


class InterpolationSweepSpec(SweepSpec):
    """``kind: interpolation``: ``drafters`` (name -> checkpoint folder, or ``random:SEED`` for a fresh
    untrained one), all of one target. Search key ``alpha`` (two drafters: ``alpha * first + (1 - alpha)
    * second``, in [0, 1]) or ``weights`` (one vector per point, one weight per drafter, each in [0, 1],
    summing to 1)."""

    kind: Literal["interpolation"]
    drafters: dict[str, str] = Field(min_length=2)

    @model_validator(mode="after")
    def _search_keys(self) -> InterpolationSweepSpec:
        k = len(self.drafters)
        for name in self.drafters:
            if not name or not all(c.isalnum() or c in "_-." for c in name):
                raise ValueError(f"drafters: name {name!r}: use letters, digits, '_', '-', '.'")
        unknown = sorted(set(self.search) - {"alpha", "weights"})
        if unknown:
            raise ValueError(f"search.{unknown[0]}: not a searchable key; allowed: alpha (two drafters), weights")
        if len(self.search) != 1:
            raise ValueError("search: give alpha or weights, not both")
        if "alpha" in self.search:
            if k != 2:
                raise ValueError(f"search.alpha interpolates two drafters, drafters has {k}; use search.weights")
            for value in self.search["alpha"].probes():
                if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                    raise ValueError(f"search.alpha: alpha must be a number in [0, 1], got {value!r}")
        else:
            dim = self.search["weights"]
            if dim.finite is None:
                raise ValueError("search.weights: give a grid or choice of weight vectors")
            for i, vector in enumerate(dim.finite):
                where = f"search.weights.{dim.kind}[{i}]"
                if not isinstance(vector, list) or len(vector) != k:
                    raise ValueError(f"{where}: need a list of {k} weights (one per drafter), got {vector!r}")
                if any(isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w <= 1 for w in vector):
                    raise ValueError(f"{where}: weights must be numbers in [0, 1], got {vector!r}")
                if abs(sum(vector) - 1.0) > 1e-6:
                    raise ValueError(f"{where}: weights must sum to 1, got {vector!r} (sum {sum(vector):g})")
        return self

    def weights_of(self, config: dict) -> list[float]:
        """The averaging weights of a trial's ``config``."""
        if "alpha" in config:
            return [float(config["alpha"]), 1.0 - float(config["alpha"])]
        return [float(w) for w in config["weights"]]


SPEC_CLASSES: dict[str, type[SweepSpec]] = {"mixture": MixtureSweepSpec, "interpolation": InterpolationSweepSpec}


def _merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, recursively; a None in ``over`` removes the key."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_spec(raw: dict, where: str = "", preset: str | None = None,
               overrides: list[str] | None = None) -> MixtureSweepSpec | InterpolationSweepSpec:
    """Validate a raw spec dict after merging ``preset`` and applying dotted ``overrides``."""
    prefix = f"invalid sweep spec{' ' + where if where else ''}"
    if not isinstance(raw, dict):
        raise SweepSpecError(f"{prefix}: top level must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    if preset is not None:
        presets = raw.get("presets") or {}
        if preset not in presets:
            raise SweepSpecError(f"{prefix}: unknown preset {preset!r}; presets: {sorted(presets)}")
        raw = _merge(raw, presets[preset])
    try:
        apply_overrides(raw, overrides or [])
    except ConfigError as err:
        raise SweepSpecError(str(err)) from None
    kind = raw.get("kind")
    if kind not in SPEC_CLASSES:
        raise SweepSpecError(f"{prefix}: kind must be one of {', '.join(SPEC_CLASSES)}, got {kind!r}")
    model = SPEC_CLASSES[kind]
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise SweepSpecError(format_validation_error(err, model, prefix)) from None


def load_spec(path: str | Path, preset: str | None = None,
              overrides: list[str] | None = None) -> MixtureSweepSpec | InterpolationSweepSpec:
    """Load a sweep spec from YAML (see module docstring)."""
    return parse_spec(load_yaml(path, "sweep spec", SweepSpecError), str(path), preset, overrides)
