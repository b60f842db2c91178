"""Typed experiment configuration.

Every section is a pydantic model with ``extra="forbid"``: an unknown key or a bad value is a
:class:`ConfigError` naming the dotted key, the value and what is allowed. Configs load from
YAML and take dotted overrides (``data.max_len=512``) whose values are parsed as YAML scalars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names key, value and rule."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class TargetConfig(Strict):
    """The frozen target LLM.

    ``model``: ``embedded:smollm2-135m`` (offline default), an HF hub id (``hf:`` prefix
    optional), a local HF folder, or a ``.gguf`` file. ``device`` ``auto`` picks cuda when a GPU
    is visible, else cpu; ``dtype`` ``auto`` picks bfloat16 on cuda and on a CPU with native bf16
    (avx512_bf16 / amx_bf16), float32 elsewhere.
    """

    model: str = "embedded:smollm2-135m"
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_context: int | None = Field(default=None, ge=16)
    threads: int | None = Field(default=None, ge=1)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda", "mps") or value.startswith("cuda:"):
            return value
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {value!r}")


SourceKind = Literal["sharegpt", "gsm8k_train", "math_train", "gsm8k_test_split", "jsonl", "hf", "mathinstruct",
                     "reasoning_gym"]


class SourceSpec(Strict):
    """One way of obtaining a training data source.

    kinds: ``sharegpt`` (``path`` to a ShareGPT JSON/JSONL, else the pinned wheel file),
    ``gsm8k_train``/``math_train`` (``$TAPS_DATA_DIR/train/*.jsonl``, or ``path``),
    ``gsm8k_test_split`` (prompt-only: the training pool of GSM8K test, ~75% by question hash, from
    the benchmark loader; the reserved rest is never trained on), ``jsonl``
    (a local JSON/JSONL of conversations or question/answer rows), ``hf`` (HF dataset ``name``,
    ``subset``, ``split``), ``mathinstruct`` (HF TIGER-Lab/MathInstruct), ``reasoning_gym``
    (offline generated math prompts; ``tasks`` names generators).
    """

    kind: SourceKind
    path: str | None = None
    name: str | None = None
    subset: str | None = None
    split: str = "train"
    tasks: list[str] = Field(default_factory=lambda: ["basic_arithmetic", "chain_sum", "fraction_simplification"])
    limit: int | None = Field(default=None, ge=1)
    seed: int = 0
    regenerate: bool = False

    @model_validator(mode="after")
    def _needs(self) -> SourceSpec:
        if self.kind == "jsonl" and not self.path:
            raise ValueError("kind 'jsonl' needs 'path'")
        if self.kind == "hf" and not self.name:
            raise ValueError("kind 'hf' needs 'name' (an HF dataset id)")
        if self.kind == "gsm8k_test_split" and (self.path or self.name):
            raise ValueError("kind 'gsm8k_test_split' reads the GSM8K test benchmark itself; it takes no 'path' or "
                             f"'name' (got path={self.path!r}, name={self.name!r})")
        if self.kind == "reasoning_gym" and "gsm_symbolic" in self.tasks:
            raise ValueError("reasoning_gym task 'gsm_symbolic' is derived from GSM8K test; not allowed")
        return self


class DatasetConfig(Strict):
    """A named training dataset: alternatives tried in order, the first available wins."""

    domain: str
    alternatives: list[SourceSpec] = Field(min_length=1)


class RegenerationConfig(Strict):
    """Response regeneration by the target (self-distillation) for prompt-only sources."""

    max_new_tokens: int = Field(default=192, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    batch_size: int = Field(default=16, ge=1)
    seed: int = 0


class FeaturesConfig(Strict):
    """Teacher-forced target features written as Parquet shards."""

    max_len: int = Field(default=384, ge=8)
    batch_tokens: int = Field(default=4096, ge=64)
    rows_per_shard: int = Field(default=256, ge=1)
    num_actors: int | None = Field(default=None, ge=1)
    regeneration: RegenerationConfig = Field(default_factory=RegenerationConfig)


class DataConfig(Strict):
    datasets: dict[str, DatasetConfig] = Field(default_factory=dict)
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)


class MixtureConfig(Strict):
    """Rows selected from cached features: by ``ratio`` of ``total`` rows, or absolute ``counts``."""

    ratio: dict[str, float] | None = None
    total: int | None = Field(default=None, ge=1)
    counts: dict[str, int] | None = None
    seed: int = 0

    @model_validator(mode="after")
    def _one_way(self) -> MixtureConfig:
        if (self.ratio is None) == (self.counts is None):
            raise ValueError("give exactly one of 'ratio' (with optional 'total') or 'counts'")
        if self.ratio is not None:
            bad = {k: v for k, v in self.ratio.items() if not 0.0 <= v <= 1.0}
            if bad:
                raise ValueError(f"ratio values must be in [0, 1], got {bad}")
            if abs(sum(self.ratio.values()) - 1.0) > 1e-6:
                raise ValueError(f"ratio values must sum to 1, got {sum(self.ratio.values())} from {self.ratio}")
        if self.counts is not None and any(v < 0 for v in self.counts.values()):
            raise ValueError(f"counts must be >= 0, got {self.counts}")
        return self


class TreeConfig(Strict):
    """EAGLE-2 dynamic draft tree: ``depth`` expansions after the first level, ``top_k`` branching,
    ``total_tokens`` verified nodes including the root, plus a prompt-lookup chain (:mod:`taps_ray.spec.lookup`).

    Defaults are the CPU setting picked by the bf16 tree sweep with ``release:math`` in
    docs/BENCHMARKS.md (depth 2, 16 nodes, lookup 8: the fastest of depth 1-3 x 8-16 nodes x lookup
    0/8); the paper's GPU setting is depth 5, top_k 10, total_tokens 60 (configs/paper-llama3-8b.yaml)."""

    depth: int = Field(default=2, ge=0)
    top_k: int = Field(default=3, ge=1)
    total_tokens: int = Field(default=16, ge=2)
    lookup_tokens: int = Field(default=8, ge=0)    # prompt-lookup chain grafted onto each tree, at most this long (0: off)
    lookup_ngram: int = Field(default=3, ge=1)     # longest context suffix matched for the lookup
    lookup_min_ngram: int = Field(default=2, ge=1)  # shortest suffix matched (shorter matches copy too eagerly)

    @model_validator(mode="after")
    def _ngram_range(self) -> TreeConfig:
        if self.lookup_min_ngram > self.lookup_ngram:
            raise ValueError(f"tree.lookup_min_ngram ({self.lookup_min_ngram}) must be <= tree.lookup_ngram "
                             f"({self.lookup_ngram})")
        return self


class SamplingConfig(Strict):
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None


class DrafterConfig(Strict):
    """Draft-head architecture knobs; sizes always come from the target."""

    draft_vocab_size: int | None = Field(default=None, ge=2)
    seed: int = 0


class ObjectiveConfig(Strict):
    """Drafter training objective.

    ``noise``: input-feature noise during training, ``uniform`` = U(-noise_std/2, noise_std/2)
    (U(-0.1, 0.1) by default), ``gaussian`` = N(0, noise_std^2). ``topk``/``topk_weight`` (w) and
    ``hass_passes`` (n) apply to ``hass`` only; HASS reference recipe: stage 1 w=0, stage 2 w=1.
    """

    algorithm: Literal["eagle2", "hass"] = "eagle2"
    feature_weight: float = Field(default=1.0, ge=0)
    ce_weight: float = Field(default=0.1, ge=0)
    noise: Literal["uniform", "gaussian", "none"] = "uniform"
    noise_std: float = Field(default=0.2, ge=0)
    topk: int = Field(default=10, ge=1)
    topk_weight: float = Field(default=1.0, ge=0)
    hass_passes: int = Field(default=3, ge=1, le=16)
    hass_detach: bool = True

    @property
    def passes(self) -> int:
        return self.hass_passes if self.algorithm == "hass" else 1


class Stage2Config(Strict):
    """Second stage of the HASS recipe: ``epochs`` more epochs with top-K distillation weight
    ``topk_weight`` and a fresh warmup + schedule peaking at ``lr`` (optimizer moments are kept)."""

    epochs: int = Field(default=1, ge=1)
    lr: float = Field(default=1e-4, gt=0)
    topk_weight: float = Field(default=1.0, ge=0)


class TrainConfig(Strict):
    """Drafter training (``taps train``); a variant's ``train`` overrides single keys.

    Optimisation: ``batch_size`` rows per worker and step (right padded to the batch's longest row),
    AdamW (0.9, 0.95) with ``weight_decay``, peak ``lr`` after ``warmup_steps`` linear warmup, then
    ``schedule`` (cosine | linear to 0, or constant), gradient norm clipped to ``grad_clip``.
    ``shuffle_buffer`` rows are shuffled together per epoch with a seeded order (``seed`` + epoch).
    ``max_tokens`` crops each training row to its first tokens (None: as prepared).
    ``vocab_source`` (with ``drafter.draft_vocab_size``): count token frequencies over the training
    pools of all datasets (``datasets``: one shared vocabulary, so specialists stay averageable) or
    over the variant's own mixture rows (``mixture``).
    Checkpoints every ``checkpoint_every`` steps and at each epoch end. Held-out metrics at each
    epoch end on ``heldout_rows`` rows per dataset (a seeded split, ``heldout_seed``, shared by
    all variants), greedy unrolled to ``eval_depth`` draft positions.
    Resources: ``num_workers`` DDP workers per variant, ``use_gpu`` (auto: when the cluster has
    GPUs), ``threads`` torch threads per CPU worker (None: the cores split fairly over all
    concurrent workers), ``max_failures`` restarts from the last checkpoint (-1: unlimited).
    ``stage2`` (HASS variants only; EAGLE-2 variants train ``epochs``): the two-stage recipe, stage 1
    runs ``epochs`` with the variant's objective (set ``objective.topk_weight: 0`` for the reference
    recipe), stage 2 runs ``stage2.epochs`` more.
    """

    epochs: int = Field(default=2, ge=1)
    batch_size: int = Field(default=4, ge=1)
    lr: float = Field(default=3e-4, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=0.5, gt=0)
    shuffle_buffer: int = Field(default=4096, ge=1)
    max_tokens: int | None = Field(default=None, ge=2)
    vocab_source: Literal["datasets", "mixture"] = "datasets"
    seed: int = 0
    checkpoint_every: int = Field(default=50, ge=1)
    log_every: int = Field(default=10, ge=1)
    heldout_rows: int = Field(default=32, ge=1)
    heldout_seed: int = 0
    eval_depth: int = Field(default=4, ge=1)
    num_workers: int = Field(default=1, ge=1)
    use_gpu: bool | Literal["auto"] = "auto"
    threads: int | None = Field(default=None, ge=1)
    max_failures: int = Field(default=1, ge=-1)
    stage2: Stage2Config | None = None


def _check_section(section: str, given: dict[str, Any], model: type[BaseModel], base: dict[str, Any]) -> BaseModel:
    """Validate ``base`` updated with ``given`` as ``model``; errors name ``section.key``."""
    unknown = sorted(set(given) - set(model.model_fields))
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; allowed keys: {', '.join(model.model_fields)}")
    try:
        return model.model_validate({**base, **given})
    except ValidationError as err:
        item = err.errors()[0]
        key = ".".join(str(p) for p in item["loc"])
        raise ValueError(f"{section}.{key}: {item['msg']} (got {item.get('input')!r})") from None


class VariantConfig(Strict):
    """One drafter to train: ``algorithm`` on the rows of mixture ``mixture``.

    ``objective`` overrides :class:`ObjectiveConfig` keys (the algorithm is the variant's);
    ``train`` overrides keys of the experiment's ``train`` section.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    algorithm: Literal["eagle2", "hass"] = "eagle2"
    mixture: str
    objective: dict[str, Any] = Field(default_factory=dict)
    train: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _overrides(self) -> VariantConfig:
        if "algorithm" in self.objective:
            raise ValueError(f"variant {self.name!r}: set 'algorithm', not 'objective.algorithm'")
        self.objective_config()
        _check_section(f"variant {self.name!r} train", self.train, TrainConfig, {})
        if self.algorithm == "eagle2" and self.train.get("stage2") is not None:
            raise ValueError(f"variant {self.name!r}: train.stage2 is the HASS recipe; algorithm is eagle2")
        return self

    def objective_config(self) -> ObjectiveConfig:
        return _check_section(f"variant {self.name!r} objective", self.objective, ObjectiveConfig,
                              {"algorithm": self.algorithm})


class DrafterServeConfig(Strict):
    """One drafter deployment of ``taps serve``.

    ``checkpoint``: a drafter folder (None: a freshly initialised drafter from ``seed``, logged as
    untrained). ``average_of`` + ``alpha``: instead, the weight average ``alpha * A + (1 - alpha) * B``
    of two other drafters of the same config (served for strategy ``averaged:ALPHA``). Resources:
    ``num_replicas`` or ``autoscaling`` (Ray Serve ``autoscaling_config`` keys), ``num_cpus``,
    ``num_gpus``, ``threads`` (torch threads per replica), ``max_ongoing_requests``.
    ``fault`` / ``delay_s`` inject failures for drills and tests: ``raise`` fails every draft call,
    ``delay_s`` sleeps before each one.
    """

    checkpoint: str | None = None
    seed: int = 0
    average_of: list[str] | None = Field(default=None, min_length=2, max_length=2)
    alpha: float = Field(default=0.5, ge=0.0, le=1.0)
    num_replicas: int = Field(default=1, ge=1)
    autoscaling: dict[str, Any] | None = None
    num_cpus: float = Field(default=0.5, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    threads: int | None = Field(default=1, ge=1)
    max_ongoing_requests: int = Field(default=32, ge=1)
    fault: Literal["raise"] | None = None
    delay_s: float = Field(default=0.0, ge=0)


def default_serve_drafters() -> dict[str, DrafterServeConfig]:
    """The shipped release drafters (``math``, ``chat``: ``release:NAME``) when the package has them, else one
    untrained ``default`` drafter."""
    from taps_ray.models.release import release_names

    shipped = [name for name in ("math", "chat") if name in release_names()]
    if not shipped:
        return {"default": DrafterServeConfig()}
    return {name: DrafterServeConfig(checkpoint=f"release:{name}") for name in shipped}


class ServeConfig(Strict):
    """``taps serve``: Drafter deployments, one Verifier (the target) and the OpenAI-compatible ingress.

    ``drafters``: name -> :class:`DrafterServeConfig`, or just a checkpoint folder or ``release:NAME``
    (default: :func:`default_serve_drafters`). ``strategy`` and ``default_drafters`` (None: every
    non-averaged drafter, in order) apply when a request names none. ``draft_deadline_s``: per step, a drafter that has not
    answered by then is skipped for that step. ``request_timeout_s``: a request's whole budget, counted
    from its arrival (queueing included; also how long an idle drafting session is kept).
    ``route_probe_steps`` / ``route_recheck_every``: request-granularity routing probes with every
    drafter for that many steps, then re-probes every that many steps (0: decides once per request).
    ``model_name``: the served model id (None: the target's name).

    Load shedding: ``max_concurrent_requests`` requests decode at once per verifier replica (Serve's
    ``max_ongoing_requests`` of the Verifier); up to ``max_queued_requests`` more wait for a slot, per
    ingress replica (Serve's ``max_queued_requests``: it counts the queue at each caller); beyond that a
    request is answered at once with a 429 and ``Retry-After: retry_after_s`` (rounded up to seconds).
    The defaults (8 decoding, 8 waiting) suit a 2-core CPU with the embedded target; on a GPU raise
    ``max_concurrent_requests`` to what fits its memory.

    Access and request limits (checked by the ingress before any decoding work):
    ``api_keys``: Bearer keys accepted on every route but ``/health`` and ``/ready`` (also ``--api-key`` and the
    comma-separated ``TAPS_API_KEY`` env; none: the endpoint is open); never dumped with the config.
    ``docs``: serve FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json``.
    ``allowed_hosts``: accepted ``Host`` header names (``*.example.com`` wildcards; empty: any).
    ``max_body_bytes``: request-body cap (413 beyond it). ``max_messages``: messages per chat request.
    ``max_prompt_chars``: characters over all messages / the prompt. ``max_stop_sequences`` and
    ``max_stop_chars``: stop strings per request and characters per stop string.
    ``max_tokens_cap``: the largest ``max_tokens`` a request may ask for.
    ``max_draft_deadline_s``: the largest ``taps.draft_deadline_s`` a request may ask for (a 400
    beyond it; None: ``draft_deadline_s``, so clients may only shorten the server's deadline).
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    app_name: str = "taps"
    model_name: str | None = None
    strategy: str = "single"
    drafters: dict[str, DrafterServeConfig] = Field(default_factory=default_serve_drafters)
    default_drafters: list[str] | None = None
    draft_deadline_s: float = Field(default=1.0, ge=0)
    request_timeout_s: float = Field(default=300.0, gt=0)
    max_tokens_default: int = Field(default=256, ge=1)
    route_probe_steps: int = Field(default=2, ge=1)
    route_recheck_every: int = Field(default=0, ge=0)
    max_concurrent_requests: int = Field(default=8, ge=1)
    max_queued_requests: int = Field(default=8, ge=1)
    retry_after_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    verifier_replicas: int = Field(default=1, ge=1)
    verifier_num_cpus: float = Field(default=1.0, ge=0)
    verifier_num_gpus: float = Field(default=0.0, ge=0)
    ingress_replicas: int = Field(default=1, ge=1)
    ingress_num_cpus: float = Field(default=0.25, ge=0)
    api_keys: list[str] = Field(default_factory=list, exclude=True, repr=False)
    docs: bool = False
    allowed_hosts: list[str] = Field(default_factory=list)
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024)
    max_messages: int = Field(default=256, ge=1)
    max_prompt_chars: int = Field(default=200_000, ge=1)
    max_stop_sequences: int = Field(default=8, ge=0)
    max_stop_chars: int = Field(default=256, ge=1)
    max_tokens_cap: int = Field(default=4096, ge=1)
    max_draft_deadline_s: float | None = Field(default=None, ge=0)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, value: list[str]) -> list[str]:
        if any(not k or not k.isascii() or not k.isprintable() or any(c.isspace() for c in k) for k in value):
            raise ValueError("serve.api_keys: each key must be non-empty printable ASCII without spaces")
        return value

    @property
    def draft_deadline_cap_s(self) -> float:
        """The largest per-request ``taps.draft_deadline_s`` accepted."""
        return self.draft_deadline_s if self.max_draft_deadline_s is None else self.max_draft_deadline_s

    @field_validator("drafters", mode="before")
    @classmethod
    def _drafter_shorthand(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: {"checkpoint": v} if v is None or isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _names(self) -> ServeConfig:
        if not self.drafters:
            raise ValueError("serve.drafters must name at least one drafter")
        for name, drafter in self.drafters.items():
            if not all(c.isalnum() or c in "_-." for c in name):
                raise ValueError(f"drafter name {name!r}: use letters, digits, '_', '-', '.'")
            for other in drafter.average_of or []:
                if other not in self.drafters or self.drafters[other].average_of:
                    raise ValueError(f"drafter {name!r}: average_of names {other!r}, which is not a plain "
                                     f"drafter of serve.drafters")
        for name in self.default_drafters or []:
            if name not in self.drafters:
                raise ValueError(f"default_drafters names unknown drafter {name!r}; drafters: {sorted(self.drafters)}")
        return self


class EvalConfig(Strict):
    """``taps eval``: ``benchmarks`` x ``strategies`` x ``temperatures`` on ``limit`` seeded questions each.

    ``drafters``: role name -> checkpoint folder, or ``random:SEED`` for a fresh untrained drafter
    (empty: two fresh drafters ``fresh0``/``fresh1``). Claims use the roles ``math``, ``chat`` and
    ``mixed``. ``compose`` (None: every drafter, in order) are the drafters that averaged, routed and
    merged strategies combine; ``single`` runs once per drafter. ``alphas``: extra ``averaged:ALPHA``
    runs of the first two ``compose`` drafters (the tau-vs-alpha curve). ``probe_steps`` /
    ``recheck_every`` set request-granularity routing (0: decide once per turn). ``num_actors`` Ray
    actors (0: in-process), each with ``threads`` torch threads (None: the cores split evenly).
    ``out``: the run folder (None: ``<output_dir>/<name>/eval``).
    """

    benchmarks: list[str] = Field(default_factory=lambda: ["mt_bench", "gsm8k", "math_500", "svamp"], min_length=1)
    strategies: list[str] = Field(default_factory=lambda: [
        "vanilla", "single", "averaged", "routed:confidence", "routed:entropy", "merged:union", "merged:budget"],
        min_length=1)
    temperatures: list[Annotated[float, Field(ge=0.0)]] = Field(default_factory=lambda: [0.0], min_length=1)
    limit: int | None = Field(default=10, ge=1)
    max_new_tokens: int = Field(default=128, ge=1)
    drafters: dict[str, str] = Field(default_factory=dict)
    compose: list[str] | None = None
    alphas: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=list)
    probe_steps: int = Field(default=2, ge=1)
    recheck_every: int = Field(default=0, ge=0)
    num_actors: int = Field(default=1, ge=0)
    threads: int | None = Field(default=None, ge=1)
    seed: int = 0
    out: str | None = None

    @model_validator(mode="after")
    def _drafter_names(self) -> EvalConfig:
        for name in self.drafters:
            if not name or not all(c.isalnum() or c in "_-." for c in name):
                raise ValueError(f"drafter name {name!r}: use letters, digits, '_', '-', '.'")
        unknown = [n for n in self.compose or [] if n not in self.drafters]
        if unknown and self.drafters:
            raise ValueError(f"compose names unknown drafter(s) {unknown}; drafters: {sorted(self.drafters)}")
        return self


class ExperimentConfig(Strict):
    name: str = "demo"
    output_dir: str = "runs"
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    mixtures: dict[str, MixtureConfig] = Field(default_factory=dict)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    tree: TreeConfig = Field(default_factory=TreeConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    variants: list[VariantConfig] = Field(default_factory=list)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    extra: Annotated[dict[str, Any], Field(default_factory=dict, description="free-form notes")]

    @model_validator(mode="after")
    def _mixtures_name_datasets(self) -> ExperimentConfig:
        known = set(self.data.datasets)
        for mix_name, mix in self.mixtures.items():
            names = set((mix.ratio or {}) | (mix.counts or {}))
            unknown = names - known
            if unknown:
                raise ValueError(
                    f"mixture {mix_name!r} names unknown dataset(s) {sorted(unknown)}; datasets: {sorted(known)}"
                )
        return self

    @model_validator(mode="after")
    def _variants_name_mixtures(self) -> ExperimentConfig:
        seen: set[str] = set()
        for variant in self.variants:
            if variant.name in seen:
                raise ValueError(f"variant name {variant.name!r} is used twice")
            seen.add(variant.name)
            if variant.mixture not in self.mixtures:
                raise ValueError(f"variant {variant.name!r}: unknown mixture {variant.mixture!r}; "
                                 f"valid mixtures: {sorted(self.mixtures)}")
            self.variant_train(variant)
        return self

    def variant_train(self, variant: VariantConfig) -> TrainConfig:
        """The experiment's ``train`` section with ``variant.train`` applied; ``stage2`` only for HASS."""
        base = self.train.model_dump()
        if variant.algorithm != "hass":
            base["stage2"] = None
        return _check_section(f"variant {variant.name!r} train", variant.train, TrainConfig, base)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load an :class:`ExperimentConfig` from YAML (or defaults when ``path`` is None)."""
    raw: dict = {}
    if path is not None:
        raw = load_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    apply_overrides(raw, overrides or [])
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, ExperimentConfig, "invalid config")) from None
