"""Sweep specs (``tune/*.yaml``) consumed by ``taps sweep``.

A spec is YAML with ``kind: mixture`` (train one drafter per data mixture) or ``kind: interpolation``
(average two or more trained drafters in weight space). Every section is a pydantic model with
``extra="forbid"``; a bad spec is a :class:`SweepSpecError` whose lines name the dotted key.

Search dimensions (``search:``) take one of ``grid: [..]`` (a plain list is a grid), ``choice:
[..]``, ``uniform: [lo, hi]``, ``loguniform: [lo, hi]`` or ``randint: [lo, hi)``; grid values are
crossed, the others are sampled ``num_samples`` times (Ray Tune's basic variant generator).
``presets`` are partial specs merged over the spec by ``--preset NAME`` (a null removes a key).
Every field carries a one-line ``description`` (``taps config-help --sweep``, docs/CONFIG.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from taps_ray.config import ObjectiveConfig, Strict, TrainConfig, TrainingOverrides, TreeConfig
from taps_ray.config_loading import ConfigError, apply_overrides, format_validation_error, load_yaml
from taps_ray.data.benchmarks import BENCHMARKS

RATIO_KEYS = ("ratio", "total", "algorithm")
SEARCHABLE_TRAIN = ("epochs", "batch_size", "lr", "warmup_steps", "schedule", "weight_decay", "grad_clip",
                    "max_tokens", "seed", "stage2")
SEARCHABLE_OBJECTIVE = tuple(k for k in ObjectiveConfig.model_fields if k != "algorithm")
PROMPT_SOURCES = ("heldout", *BENCHMARKS)


class SweepSpecError(ConfigError):
    """A sweep spec is invalid; each line names the dotted key, the value and the rule."""


class SweepError(ValueError):
    """A sweep cannot run as asked (printed as one line by the CLI)."""


class Dimension(Strict):
    """One search dimension: exactly one of ``grid``, ``choice``, ``uniform``, ``loguniform``, ``randint``."""

    grid: list[Any] | None = Field(default=None, description=(
        "values crossed with the other grids (a plain list is a grid)"))
    choice: list[Any] | None = Field(default=None, description="values sampled num_samples times")
    uniform: tuple[float, float] | None = Field(default=None, description="[lo, hi]: sampled uniformly")
    loguniform: tuple[float, float] | None = Field(default=None, description=(
        "[lo, hi], lo > 0: sampled uniformly in log space"))
    randint: tuple[int, int] | None = Field(default=None, description="[lo, hi): an integer sampled uniformly")

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

    kind: Literal["mean", "worst", "domain"] = Field(default="mean", description=(
        "mean tau over domains, the worst domain's tau, or one domain's tau"))
    domain: str | None = Field(default=None, description="the domain of kind domain (a key of eval.prompts)")

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
    """Held-out prompts of one domain, never trained on."""

    source: str = Field(default="heldout", description=(
        "heldout (the user turns of feature set dataset's held-out rows, the split of train.heldout_rows) or a "
        "benchmark's first turns: mt_bench, gsm8k, math_500, svamp"))
    dataset: str | None = Field(default=None, description=(
        "feature set of the heldout prompts and of the domain's simulated tau in mixture training (None: the "
        "domain's name)"))
    limit: int = Field(default=8, ge=1, description="prompts of the domain")
    seed: int = Field(default=0, description="seed of the prompt choice")

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

    prompts: dict[str, PromptSpec] = Field(min_length=1, description=(
        "domain -> its held-out prompts, or just the source name"))
    max_new_tokens: int = Field(default=64, ge=1, description="new tokens decoded after each prompt")
    tree: TreeConfig | None = Field(default=None, description="draft tree (None: the experiment's tree)")

    @field_validator("prompts", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: {"source": v} if isinstance(v, str) else v for k, v in value.items()}
        return value


class ResourcesSpec(Strict):
    """Resources of one trial: a mixture trial is a light Tune actor driving a Ray Train run, then a Ray
    task that measures tau; an interpolation trial is one actor."""

    num_workers: int = Field(default=1, ge=1, description="mixture: Ray Train workers per trial")
    cpus_per_worker: float = Field(default=1.0, gt=0, description=(
        "mixture: CPUs per training worker (1 CPU + 1 GPU with use_gpu)"))
    use_gpu: bool | Literal["auto"] = Field(default="auto", description=(
        "one GPU per training worker and per tau measurement (auto: when the cluster has GPUs)"))
    eval_cpus: float = Field(default=1.0, gt=0, description="CPUs of the task or actor that measures tau")
    trial_cpus: float = Field(default=0.25, gt=0, description="mixture: CPUs of the Tune actor driving the run")
    reserve_cpus: float = Field(default=0.0, ge=0, description=(
        "mixture: CPUs the trials leave free for other work on the cluster"))
    threads: int | None = Field(default=None, ge=1, description="torch threads per process (None: its CPUs)")
    max_concurrent_trials: int | None = Field(default=None, ge=1, description=(
        "trials at once (None: as many as the cluster fits)"))


class SchedulerSpec(Strict):
    """Early stopping of mixture trials on the simulated objective (the objective over the domains'
    held-out simulated tau, reported each epoch)."""

    kind: Literal["asha", "none"] = Field(default="asha", description=(
        "asha: stop trials below the top 1 / reduction_factor at epochs grace_period * reduction_factor**k; "
        "none: run every trial to the end"))
    grace_period: int = Field(default=1, ge=1, description="epochs before the first ASHA comparison")
    reduction_factor: float = Field(default=2.0, gt=1, description="ASHA keeps the top 1 / reduction_factor")


class MixtureBase(TrainingOverrides):
    """The drafter every mixture trial trains, before the trial's search values apply; ``algorithm``,
    ``objective`` and ``train`` are a variant's keys."""

    datasets: list[str] = Field(min_length=2, max_length=2, description="the two feature sets mixed")
    ratio: float = Field(default=0.5, ge=0.0, le=1.0, description=(
        "share of the first dataset (math:chat = ratio:1-ratio)"))
    total: int | None = Field(default=None, ge=1, description="rows mixed (None: as many as the pools allow)")
    seed: int = Field(default=0, description="seed of the row selection")
    algorithm: Literal["eagle2", "hass", "eagle3"] = Field(default="hass", description="training objective's algorithm")

    def _owner(self) -> str:
        return "base"

    @model_validator(mode="after")
    def _distinct(self) -> MixtureBase:
        if self.datasets[0] == self.datasets[1]:
            raise ValueError(f"datasets must be two different feature sets, got {self.datasets}")
        return self


class SweepSpec(Strict):
    """Keys shared by both kinds of sweep spec."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description=(
        "sweep name: its output folder is runs/<experiment>/sweeps/<name>"))
    experiment: str = Field(default="configs/demo.yaml", description="the experiment config the trials use")
    num_samples: int = Field(default=1, ge=1, description=(
        "samples of the non-grid dimensions (per grid point)"))
    max_failures: int = Field(default=1, ge=0, description="retries per trial before it is reported failed")
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec, description=(
        "what the sweep maximises: mean, worst or domain:NAME"))
    eval: EvalSpec = Field(description="how a trial's drafter is scored")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="resources of one trial")
    search: dict[str, Dimension] = Field(description="search key -> its dimension (at least one)")
    presets: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "name -> partial spec merged over this one by --preset NAME (a null removes a key)"))

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
    ``total`` (rows), ``algorithm`` (eagle2 | hass | eagle3), ``train.KEY`` and ``objective.KEY`` (training
    knobs of the variant). Each trial reports its simulated objective per epoch (for ``scheduler``)
    and, at the end, tau per domain on the held-out prompts."""

    kind: Literal["mixture"] = Field(description="mixture: train one drafter per data mixture")
    mixture: MixtureBase = Field(description="the drafter every trial trains before its search values apply")
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec, description="early stopping of trials")

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
        if value not in ("eagle2", "hass", "eagle3"):
            raise ValueError(f"algorithm must be eagle2, hass or eagle3, got {value!r}")
    else:
        section, field = key.split(".", 1)
        _check_value(TrainConfig if section == "train" else ObjectiveConfig, field, value)


class InterpolationSweepSpec(SweepSpec):
    """``kind: interpolation``: search key ``alpha`` (two drafters: ``alpha * first + (1 - alpha) * second``,
    in [0, 1]) or ``weights`` (one vector per point, one weight per drafter, each in [0, 1], summing to 1)."""

    kind: Literal["interpolation"] = Field(description=(
        "interpolation: average two or more trained drafters in weight space"))
    drafters: dict[str, str] = Field(min_length=2, description=(
        "name -> drafter folder, or random:SEED for a fresh untrained one; all of one target"))

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
