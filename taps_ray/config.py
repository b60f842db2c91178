"""Typed experiment configuration.

Every section is a pydantic model with ``extra="forbid"``: an unknown key or a bad value is a
:class:`ConfigError` naming the dotted key, the value and what is allowed. Configs load from
YAML and take dotted overrides (``data.features.max_len=512``) whose values are parsed as YAML.
Every field carries a one-line ``description``: ``taps config-help`` prints them with each dotted
key, type and default, and docs/CONFIG.md is that command's output. The ``serve`` section is
:mod:`taps_ray.config_serve`; reading files and overrides is :mod:`taps_ray.config_loading`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from taps_ray.config_loading import (
    ConfigError,
    Strict,
    apply_overrides,
    check_section,
    format_validation_error,
    load_yaml,
)
from taps_ray.config_serve import RouteProbe, ServeConfig


class TargetConfig(Strict):
    """The frozen target LLM every drafter is trained for and every decoding verifies with."""

    model: str = Field(default="embedded:smollm2-135m", description=(
        "embedded:smollm2-135m (offline default), an HF hub id (hf: prefix optional), a local HF folder or a "
        ".gguf file"))
    device: str = Field(default="auto", description=(
        "auto (cuda when a GPU is visible, else cpu), cpu, cuda, cuda:N or mps"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(default="auto", description=(
        "auto: bfloat16 on cuda and on a CPU with native bf16 (avx512_bf16 / amx_bf16), float32 elsewhere"))
    max_context: int | None = Field(default=None, ge=16, description=(
        "cap on the target's context window in tokens (None: its max_position_embeddings)"))
    threads: int | None = Field(default=None, ge=1, description=(
        "torch threads of a CPU target in this process (None: torch's default)"))
    engine: Literal["auto", "static", "hf"] = Field(default="auto", description=(
        "auto: the static-cache engine (models/engine.py) for Llama, Mistral, Qwen2/3 and Phi-3 targets, "
        "transformers' forward for other families; static: require it; hf: always transformers' forward"))
    weights: Literal["auto", "dense", "int4", "fp16", "q4q8"] = Field(default="auto", description=(
        "the static engine's weights: dense (target.dtype); int4 (4-bit codes in groups of 32, a GGUF's own Q4_1 or "
        "round-to-nearest; torch's kernel; CPU, bf16); q4q8 (those codes times int8 activations, llama.cpp's Q4_1 x "
        "Q8_1; a C kernel built at first use; CPU); fp16 (fbgemm, float32 activations, CPU); auto: int4 with compile "
        "wherever int4 runs, else q4q8 (int4 without a C compiler) on a CPU with native bf16, fp16 from dtype auto "
        "without it, else dense"))
    int4_max_rows: int | None = Field(default=None, ge=1, description=(
        "int4 weights of a GGUF target: steps of up to this many tokens read the 4-bit codes, wider ones the "
        "packed dense copy; None: measured on this machine with the cost model (seconds, once, cached under "
        "TAPS_CACHE)"))
    graphs: Literal["auto", "on", "off"] = Field(default="auto", description=(
        "CUDA graphs of the static engine's steps of up to 64 tokens on one request (models/graphs.py): auto = on "
        "for a CUDA target on the static engine without sliding-window layers, off elsewhere (CPU and MPS have "
        "none); on: required (an error where they cannot run)"))
    compile: bool = Field(default=False, description=(
        "run one request's narrow int4 steps on CPU as one inductor-compiled forward (models/compiled.py): faster "
        "steps for a compile of each graph at start-up (docs/BENCHMARKS.md has both); an error where it cannot run "
        "(not int4 on CPU, sliding windows, q/k norms)"))

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda", "mps") or value.startswith("cuda:"):
            return value
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {value!r}")


SourceKind = Literal["sharegpt", "gsm8k_train", "math_train", "gsm8k_test_split", "jsonl", "hf", "mathinstruct",
                     "reasoning_gym", "features"]


class SourceSpec(Strict):
    """One way of obtaining a training data source (see :mod:`taps_ray.data.sources` per kind)."""

    kind: SourceKind = Field(description=(
        "sharegpt (path, else the pinned wheel file); gsm8k_train / math_train ($TAPS_DATA_DIR/train/*.jsonl or "
        "path); gsm8k_test_split (prompt-only: the ~75% training pool of GSM8K test by question hash, the rest "
        "is never trained on); jsonl (a local JSON/JSONL of conversations or question/answer rows); hf (HF "
        "dataset name, subset, split); mathinstruct (HF TIGER-Lab/MathInstruct); reasoning_gym (offline "
        "generated math prompts from tasks); features (path: a complete feature-set folder, such as a serving "
        "capture, trained on as it is; the dataset's only alternative)"))
    path: str | None = Field(default=None, description=(
        "local JSON/JSONL file (needed by jsonl; optional for sharegpt, gsm8k_train, math_train)"))
    name: str | None = Field(default=None, description="HF dataset id (needed by hf; mathinstruct's by default)")
    subset: str | None = Field(default=None, description="HF dataset configuration (subset) name")
    split: str = Field(default="train", description="HF dataset split")
    tasks: list[str] = Field(default_factory=lambda: ["basic_arithmetic", "chain_sum", "fraction_simplification"],
                             description="reasoning_gym generators the prompts are split over (not gsm_symbolic)")
    limit: int | None = Field(default=None, ge=1, description=(
        "keep a seeded subset of this many conversations (None: all; reasoning_gym: 1000 per task)"))
    seed: int = Field(default=0, description="seed of the limit subset and of the reasoning_gym generators")
    regenerate: bool = Field(default=False, description=(
        "treat the source as prompt-only: the target answers its prompts (self-distillation)"))

    @model_validator(mode="after")
    def _needs(self) -> SourceSpec:
        if self.kind in ("jsonl", "features") and not self.path:
            raise ValueError(f"kind {self.kind!r} needs 'path'")
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

    domain: str = Field(description="the task domain the dataset stands for (math, chat, ...)")
    alternatives: list[SourceSpec] = Field(min_length=1, description=(
        "sources tried in order; the first available one is used (the log says which)"))

    @model_validator(mode="after")
    def _features_alone(self) -> DatasetConfig:
        if len(self.alternatives) > 1 and any(a.kind == "features" for a in self.alternatives):
            raise ValueError("a 'features' source is a feature set itself: make it the dataset's only alternative")
        return self

    @property
    def feature_folder(self) -> str | None:
        """The folder of a ``features`` dataset (a feature set read as it is), else None."""
        return self.alternatives[0].path if self.alternatives[0].kind == "features" else None


class RegenerationConfig(Strict):
    """Response regeneration by the target (self-distillation) for prompt-only sources."""

    max_new_tokens: int = Field(default=192, ge=1, description="longest answer the target writes per prompt")
    temperature: float = Field(default=0.0, ge=0.0, description="sampling temperature of the answers (0: greedy)")
    batch_size: int = Field(default=16, ge=1, description=(
        "prompts decoded together (throughput only: not part of the feature cache key)"))
    seed: int = Field(default=0, description="sampling seed (offset by each row's id)")
    drafter: str | None = Field(default="auto", description=(
        "drafter that speeds the answers up, losslessly (a folder or release:NAME; auto: the shipped "
        "release:math drafter when it fits the target; None: plain decoding); not part of the cache key"))


class FeaturesConfig(Strict):
    """Teacher-forced target features written as Parquet shards."""

    max_len: int = Field(default=384, ge=8, description="tokens per conversation; longer ones are cut")
    batch_tokens: int = Field(default=4096, ge=64, description=(
        "tokens per target forward batch (rows per batch: batch_tokens // max_len)"))
    rows_per_shard: int = Field(default=256, ge=1, description="rows per Parquet shard")
    layers: Literal["auto", "last", "eagle3"] = Field(default="auto", description=(
        "target hidden states stored per token: last (the last one), eagle3 (EAGLE-3's three layers and the last; "
        "4x the disk), auto (eagle3 for the datasets an eagle3 variant's mixture reads, else last)"))
    num_actors: int | None = Field(default=None, ge=1, description="Ray Data target actors (None: one per GPU, or one on CPU)")
    regeneration: RegenerationConfig = Field(default_factory=RegenerationConfig, description=(
        "how the target answers prompt-only sources"))


class DataConfig(Strict):
    """Training datasets and the target features computed from them (``taps prepare``)."""

    datasets: dict[str, DatasetConfig] = Field(default_factory=dict, description=(
        "dataset name -> where its conversations come from"))
    features: FeaturesConfig = Field(default_factory=FeaturesConfig, description=(
        "teacher-forced target features of the datasets"))


class MixtureConfig(Strict):
    """Rows selected from cached features: by ``ratio`` of ``total`` rows, or absolute ``counts``."""

    ratio: dict[str, float] | None = Field(default=None, description=(
        "dataset -> share of the rows, each in [0, 1], summing to 1 (give ratio or counts)"))
    total: int | None = Field(default=None, ge=1, description=(
        "rows selected by ratio (None: as many as the pools allow)"))
    counts: dict[str, int] | None = Field(default=None, description="dataset -> number of rows (give ratio or counts)")
    seed: int = Field(default=0, description="seed of the row selection from each dataset's training pool")

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
    """EAGLE-2 dynamic draft tree plus a prompt-lookup chain (:mod:`taps_ray.spec.lookup`).

    Defaults: the CPU setting picked by the tree sweep in docs/BENCHMARKS.md; the paper's GPU setting is
    depth 5, top_k 10, total_tokens 60 (configs/paper-llama3-8b.yaml)."""

    depth: int = Field(default=2, ge=0, description="expansions after the first level of the draft tree")
    top_k: int = Field(default=3, ge=1, description="branching: children drafted per expanded node")
    total_tokens: int = Field(default=16, ge=2, description="nodes verified per step, the root included")
    lookup_tokens: int = Field(default=8, ge=0, description=(
        "prompt-lookup chain grafted onto each tree, at most this long (0: off)"))
    adaptive: bool = Field(default=True, description=(
        "size each step's tree from the measured cost model (depth, top_k, total_tokens and lookup_tokens "
        "become upper bounds; a plain step when drafting does not pay); false pins the configured tree"))
    lookup_ngram: int = Field(default=3, ge=1, description="longest context suffix matched for the lookup")
    lookup_min_ngram: int = Field(default=2, ge=1, description=(
        "shortest suffix matched (shorter matches copy too eagerly)"))

    @model_validator(mode="after")
    def _ngram_range(self) -> TreeConfig:
        if self.lookup_min_ngram > self.lookup_ngram:
            raise ValueError(f"tree.lookup_min_ngram ({self.lookup_min_ngram}) must be <= tree.lookup_ngram "
                             f"({self.lookup_ngram})")
        return self


class SamplingConfig(Strict):
    """Default sampling: ``taps generate``'s (its flags override it), ``taps eval``'s ``top_p`` / ``top_k``
    (temperatures come from ``eval.temperatures``) and the server's for requests that give none."""

    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy; > 0 samples (lossless at any value)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling mass (1: off)")
    top_k: int = Field(default=0, ge=0, description="sample among the k most likely tokens (0: off)")
    seed: int | None = Field(default=None, description="sampling seed (None: unseeded)")


class DrafterConfig(Strict):
    """Draft-head architecture knobs; sizes always come from the target."""

    draft_vocab_size: int | None = Field(default=None, ge=2, description=(
        "draft from the most frequent training tokens only (None: the target's whole vocabulary)"))
    seed: int = Field(default=0, description="seed of a freshly initialised drafter")


class ObjectiveConfig(Strict):
    """Drafter training objective (:mod:`taps_ray.train.losses`); HASS reference recipe: stage 1
    ``topk_weight`` 0, stage 2 ``topk_weight`` 1."""

    algorithm: Literal["eagle2", "hass", "eagle3"] = Field(default="eagle2", description=(
        "eagle2 (one teacher-forced pass), hass (harmonized multi-pass distillation) or eagle3 (the EAGLE-3 "
        "drafter on three target layers, trained with training-time test)"))
    feature_weight: float = Field(default=1.0, ge=0, description="weight of the SmoothL1 feature regression")
    ce_weight: float = Field(default=0.1, ge=0, description="weight of the soft cross-entropy to the target")
    noise: Literal["uniform", "gaussian", "none"] = Field(default="uniform", description=(
        "input-feature noise in training: uniform = U(-noise_std/2, noise_std/2), gaussian = N(0, noise_std^2)"))
    noise_std: float = Field(default=0.2, ge=0, description=(
        "scale of the feature noise (the default uniform noise is U(-0.1, 0.1))"))
    topk: int = Field(default=10, ge=1, description="hass only: K of the top-K distillation loss")
    topk_weight: float = Field(default=1.0, ge=0, description="hass only: weight w of the top-K distillation loss")
    hass_passes: int = Field(default=3, ge=1, le=16, description=(
        "hass only: passes n, each feeding the drafter its own earlier features"))
    hass_detach: bool = Field(default=True, description=(
        "hass only: stop the gradient through earlier passes' features"))
    ttt_steps: int = Field(default=3, ge=1, le=16, description=(
        "eagle3 only: training-time test unroll k, each step feeding the drafter its own outputs (a loss at each)"))

    @property
    def passes(self) -> int:
        return {"hass": self.hass_passes, "eagle3": self.ttt_steps}.get(self.algorithm, 1)


class Stage2Config(Strict):
    """Second stage of the HASS recipe: more epochs with a fresh warmup + schedule (optimizer moments
    are kept)."""

    epochs: int = Field(default=1, ge=1, description="epochs of stage 2, after the variant's train.epochs")
    lr: float = Field(default=1e-4, gt=0, description="peak learning rate of stage 2's schedule")
    topk_weight: float = Field(default=1.0, ge=0, description="top-K distillation weight in stage 2")


class TrainConfig(Strict):
    """Drafter training (``taps train``): AdamW (0.9, 0.95), linear warmup then a schedule, one Ray Train
    run per variant; checkpoints every ``checkpoint_every`` steps and at each epoch end, held-out
    metrics at each epoch end. A variant's ``train`` overrides single keys."""

    epochs: int = Field(default=2, ge=1, description="training epochs (stage 1 of a HASS variant with stage2)")
    batch_size: int = Field(default=4, ge=1, description=(
        "rows per worker and step (right padded to the batch's longest row)"))
    lr: float = Field(default=3e-4, gt=0, description="peak AdamW learning rate, reached after warmup_steps")
    warmup_steps: int = Field(default=0, ge=0, description="steps of linear warmup to lr")
    schedule: Literal["cosine", "linear", "constant"] = Field(default="cosine", description=(
        "after warmup: cosine or linear decay to 0, or constant"))
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(default=0.5, gt=0, description="gradient norm clip")
    shuffle_buffer: int = Field(default=4096, ge=1, description=(
        "rows shuffled together per epoch, in a seeded order (seed + epoch)"))
    max_tokens: int | None = Field(default=None, ge=2, description=(
        "crop each training row to its first tokens (None: as prepared)"))
    vocab_source: Literal["datasets", "mixture"] = Field(default="datasets", description=(
        "with drafter.draft_vocab_size: count token frequencies over all datasets' training pools (one shared "
        "vocabulary, so specialists stay averageable) or over the variant's own mixture rows"))
    seed: int = Field(default=0, description="seed of the shuffle order")
    checkpoint_every: int = Field(default=50, ge=1, description="steps between checkpoints (and at each epoch end)")
    log_every: int = Field(default=10, ge=1, description="steps between metrics.jsonl / TensorBoard entries")
    heldout_rows: int = Field(default=32, ge=1, description=(
        "held-out rows per dataset for the epoch-end metrics, never trained on"))
    heldout_seed: int = Field(default=0, description="seed of the held-out split (shared by all variants)")
    eval_depth: int = Field(default=4, ge=1, description="draft positions the held-out metrics unroll greedily")
    num_workers: int = Field(default=1, ge=1, description="DDP workers per variant")
    use_gpu: bool | Literal["auto"] = Field(default="auto", description=(
        "train on GPUs (auto: when the cluster has GPUs)"))
    threads: int | None = Field(default=None, ge=1, description=(
        "torch threads per CPU worker (None: the cores split fairly over all concurrent workers)"))
    max_failures: int = Field(default=1, ge=-1, description="restarts from the last checkpoint (-1: unlimited)")
    stage2: Stage2Config | None = Field(default=None, description=(
        "HASS variants only: the two-stage recipe, stage2.epochs more after epochs (None: one stage)"))
    init_from: str | None = Field(default=None, description=(
        "drafter folder or release:NAME training starts from: its weights and draft vocabulary (None: a fresh "
        "drafter of drafter.seed); taps adapt sets it to the drafter it fine-tunes"))


class TrainingOverrides(Strict):
    """Overrides of the experiment's ``objective`` and ``train`` sections for one drafter (a variant, a
    sweep's trials), checked against those sections as the config loads; subclasses declare
    ``algorithm`` and name themselves in errors (:meth:`_owner`)."""

    if TYPE_CHECKING:
        algorithm: str
    objective: dict[str, Any] = Field(default_factory=dict, description=(
        "overrides of objective keys (ObjectiveConfig, not algorithm)"))
    train: dict[str, Any] = Field(default_factory=dict, description=(
        "overrides of keys of the experiment's train section"))

    def _owner(self) -> str:
        """Whose overrides these are, as an error names them."""
        return "overrides"

    @model_validator(mode="after")
    def _overrides(self) -> TrainingOverrides:
        if "algorithm" in self.objective:
            raise ValueError(f"{self._owner()}: set 'algorithm', not 'objective.algorithm'")
        self.objective_config()
        check_section(f"{self._owner()} train", self.train, TrainConfig, {})
        if self.algorithm == "eagle2" and self.train.get("stage2") is not None:
            raise ValueError(f"{self._owner()}: train.stage2 is the HASS recipe; algorithm is eagle2")
        return self

    def objective_config(self) -> ObjectiveConfig:
        return check_section(f"{self._owner()} objective", self.objective, ObjectiveConfig,
                              {"algorithm": self.algorithm})


class VariantConfig(TrainingOverrides):
    """One drafter to train: ``algorithm`` on the rows of mixture ``mixture``."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description=(
        "variant name: its folder runs/<name>/drafters/<variant>"))
    algorithm: Literal["eagle2", "hass", "eagle3"] = Field(default="eagle2", description=(
        "training objective's algorithm (eagle3 trains an EAGLE-3 drafter)"))
    mixture: str = Field(description="name of the mixture (a key of mixtures) it trains on")

    def _owner(self) -> str:
        return f"variant {self.name!r}"


class EvalConfig(RouteProbe):
    """``taps eval``: ``benchmarks`` x ``strategies`` x ``temperatures`` on ``limit`` seeded questions
    each; the report's claims use the drafter roles ``math``, ``chat`` and ``mixed``. Its probe knobs
    (:class:`RouteProbe`) are ``serve.routing``'s."""

    benchmarks: list[str] = Field(default_factory=lambda: ["mt_bench", "gsm8k", "math_500", "svamp"], min_length=1,
                                  description="benchmarks evaluated: mt_bench, gsm8k, math_500, svamp")
    strategies: list[str] = Field(default_factory=lambda: [
        "vanilla", "single", "averaged", "routed:confidence", "routed:entropy", "merged:union", "merged:budget"],
        min_length=1, description="strategies run on every question (single runs once per drafter)")
    temperatures: list[Annotated[float, Field(ge=0.0)]] = Field(default_factory=lambda: [0.0], min_length=1,
                                                                description="sampling temperatures (0: greedy)")
    limit: int | None = Field(default=10, ge=1, description="seeded questions per benchmark (None: all)")
    max_new_tokens: int = Field(default=128, ge=1, description="new tokens per turn")
    drafters: dict[str, str] = Field(default_factory=dict, description=(
        "role name -> drafter folder, or random:SEED for a fresh untrained one (empty: fresh0 and fresh1)"))
    compose: list[str] | None = Field(default=None, description=(
        "the drafters averaged, routed and merged strategies combine, in order (None: every drafter)"))
    alphas: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=list, description=(
        "extra averaged:ALPHA runs of the first two compose drafters (the tau-vs-alpha curve)"))
    method: Literal["paper", "production", "both"] = Field(default="both", description=(
        "paper: the paper's fixed trees without prompt lookup (tau, entropy, depth tables and claims); "
        "production: the configured tree (cost-model sizing, lookup); both: paper records for the tables "
        "and claims, production records beside them for the speed table"))
    num_actors: int = Field(default=1, ge=0, description="Ray actors the questions are sharded over (0: in-process)")
    threads: int | None = Field(default=None, ge=1, description=(
        "torch threads per actor (None: the cores split evenly)"))
    seed: int = Field(default=0, description="seed of the question selection and of sampling")
    out: str | None = Field(default=None, description="the run folder (None: <output_dir>/<name>/eval)")

    @model_validator(mode="after")
    def _drafter_names(self) -> EvalConfig:
        for name in self.drafters:
            if not name or not all(c.isalnum() or c in "_-." for c in name):
                raise ValueError(f"drafter name {name!r}: use letters, digits, '_', '-', '.'")
        unknown = [n for n in self.compose or [] if n not in self.drafters]
        if unknown and self.drafters:
            raise ValueError(f"compose names unknown drafter(s) {unknown}; drafters: {sorted(self.drafters)}")
        return self


class AdaptConfig(Strict):
    """``taps adapt``: fine-tune a drafter on captured serving traffic mixed with its original datasets;
    with ``--watch``, the capture -> adapt -> gated promotion loop beside a running ``taps serve``."""

    traffic_share: float = Field(default=0.5, ge=0.0, le=1.0, description=(
        "share of the training rows taken from the traffic (the rest split evenly over the drafter's original "
        "datasets, against forgetting); --traffic-share overrides it. tune/adapt.yaml sweeps the same share as a mixture "
        "sweep's ratio of datasets [traffic, ORIGINAL] with train.init_from"))
    rows: int | None = Field(default=None, ge=1, description=(
        "training rows in all (None: as many as the traffic and original pools allow at traffic_share)"))
    drafter: str | None = Field(default=None, description=(
        "taps adapt --watch: the serve.drafters drafter it adapts and promotes into (None: the first plain one)"))
    every: int = Field(default=128, ge=1, description=(
        "taps adapt --watch: newly captured requests between two adaptations"))
    margin: float = Field(default=0.05, ge=0.0, description=(
        "promotion gate: the largest held-out tau loss on any prepared domain (its own or guarded) a new "
        "version may have"))
    min_gain: float = Field(default=0.0, ge=0.0, description=(
        "promotion gate: the held-out traffic tau gain a new version must exceed"))
    poll_s: float = Field(default=10.0, gt=0, allow_inf_nan=False, description=(
        "taps adapt --watch: seconds between looks at the capture folder (and re-applying a promotion to new replicas)"))
    rounds: int | None = Field(default=None, ge=1, description=(
        "taps adapt --watch: adaptations before it stops (None: until Ctrl-C)"))
    keep: int = Field(default=2, ge=1, description=(
        "taps adapt --watch: promoted versions of its drafter whose adapt-vN folders it keeps (the one serving "
        "and keep - 1 before it, to roll back to); after each round it deletes its other versions but the "
        "newest, and every traffic snapshot but the newest round's"))


class ExperimentConfig(Strict):
    """One experiment (``configs/*.yaml``): every ``taps`` command reads its sections from it."""

    name: str = Field(default="demo", description="experiment name: outputs go to <output_dir>/<name>")
    output_dir: str = Field(default="runs", description=(
        "folder of all runs (shared storage on a multi-node cluster)"))
    target: TargetConfig = Field(default_factory=TargetConfig, description="the frozen target LLM")
    data: DataConfig = Field(default_factory=DataConfig, description="training datasets and target features")
    mixtures: dict[str, MixtureConfig] = Field(default_factory=dict, description=(
        "mixture name -> a row selection over the datasets' features"))
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="draft-head architecture knobs")
    tree: TreeConfig = Field(default_factory=TreeConfig, description="the draft tree every strategy verifies")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="default sampling of generate, eval and serve")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="taps eval: benchmarks x strategies")
    train: TrainConfig = Field(default_factory=TrainConfig, description="taps train: settings of every variant")
    variants: list[VariantConfig] = Field(default_factory=list, description="the drafters taps train trains")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="taps serve: deployments and limits")
    adapt: AdaptConfig = Field(default_factory=AdaptConfig, description=(
        "taps adapt: traffic share and rows of a drafter's fine-tuning on captured traffic"))
    extra: Annotated[dict[str, Any], Field(default_factory=dict, description=(
        "free-form notes (not read by any command)"))]

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
        return check_section(f"variant {variant.name!r} train", variant.train, TrainConfig, base)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


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
