"""``taps sweep``: Ray Tune sweeps over data-mixture ratios and checkpoint-interpolation weights.

:func:`run_sweep` checks the trials' resources against ``ray.cluster_resources()`` before anything
starts, resolves on the driver everything trials need (the target's embedding and LM head and the
held-out feature rows in the object store, held-out prompts as token ids, absolute paths), runs a
``Tuner`` (or ``Tuner.restore`` with ``resume``: finished trials are kept, unfinished ones run) and
writes, under ``runs/<experiment>/sweeps/<name>/`` (or ``out``): ``results.csv`` (one row per trial:
config, tau per domain, objective, wall time, status), a PNG plot (tau per domain vs ratio, or vs
alpha: the paper's Figure 6), ``best.json`` (the best config and its drafter's path) and
``sweep.json`` (the settings a resumed sweep must share). Ray Tune's own state is in ``tune/``, each
trial's outputs (drafter, Ray Train run, attempts) in ``trials/<trial_id>/``.

A trial that fails is retried ``max_failures`` times, then reported as failed; the sweep goes on.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taps_ray import faults
from taps_ray.config import ExperimentConfig, load_config
from taps_ray.runstate import atomic_write, changed_settings, describe_changes, folder_lock, write_json
from taps_ray.sweeps.config import InterpolationSweepSpec, MixtureSweepSpec, SweepSpec, load_spec
from taps_ray.sweeps.trial import count_attempts

log = logging.getLogger(__name__)

TUNE_DIR = "tune"
STATE_FILE = "sweep.json"
RESULTS = "results.csv"
BEST = "best.json"


class SweepError(ValueError):
    """A sweep cannot run as asked (printed as one line by the CLI)."""


@dataclass
class TrialResources:
    """Resources one trial holds at its peak, and how many trials run at once."""

    use_gpu: bool
    actor: dict[str, float]
    cpus: float
    gpus: float
    reserve_cpus: float
    max_concurrent: int
    describe: str


@dataclass
class TrialRow:
    """One trial of a finished (or interrupted) sweep."""

    trial_id: str
    status: str
    config: dict[str, Any]
    metrics: dict[str, Any]
    attempts: int
    error: str | None = None

    @property
    def objective(self) -> float:
        value = self.metrics.get("objective")
        return math.nan if value is None else float(value)


@dataclass
class SweepSummary:
    """Everything ``taps sweep`` prints and writes."""

    name: str
    kind: str
    out: Path
    objective: str
    domains: list[str]
    keys: list[str]
    rows: list[TrialRow]
    wall_s: float
    expected: int = 0
    best: TrialRow | None = None
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def failed(self) -> list[TrialRow]:
        return [r for r in self.rows if r.status == "failed"]

    @property
    def unfinished(self) -> int:
        """Trials that did not finish: interrupted ones and those never started."""
        return sum(r.status == "unfinished" for r in self.rows) + max(0, self.expected - len(self.rows))


# -- resources -------------------------------------------------------------------------------------

def _fmt(resources: dict[str, float]) -> str:
    return " + ".join(f"{v:g} {k}" for k, v in resources.items() if v) or "nothing"


def plan_resources(spec: SweepSpec, cluster: dict[str, float], nodes: list[dict[str, float]]) -> TrialResources:
    """Per-trial resources of ``spec`` on a cluster with ``cluster`` totals and ``nodes`` (each
    node's resources); SweepError when one trial cannot fit."""
    res = spec.resources
    have_cpu, have_gpu = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    if res.use_gpu is True and have_gpu < 1:
        raise SweepError("resources.use_gpu is true but the cluster has no GPUs (ray.cluster_resources() "
                         f"= {_fmt({'CPU': have_cpu, 'GPU': have_gpu})}); set resources.use_gpu: auto or false")
    use_gpu = have_gpu >= 1 if res.use_gpu == "auto" else bool(res.use_gpu)
    gpu = 1.0 if use_gpu else 0.0
    evaluation = {"CPU": res.eval_cpus, "GPU": gpu}
    if isinstance(spec, MixtureSweepSpec):
        worker = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": res.cpus_per_worker}
        actor = {"CPU": res.trial_cpus}
        train_cpu = res.num_workers * worker["CPU"]
        cpus = res.trial_cpus + max(train_cpu, res.eval_cpus)
        gpus = max(res.num_workers * worker.get("GPU", 0.0), gpu)
        reserve = res.reserve_cpus
        bundles = {"a Ray Train worker": worker, "the evaluation task": evaluation}
        describe = (f"the trial actor ({res.trial_cpus:g} CPU) + max({res.num_workers} Ray Train worker(s) x "
                    f"{_fmt(worker)}, evaluation {_fmt(evaluation)}); {reserve:g} CPU kept free for Ray Data")
    else:
        actor = evaluation
        cpus, gpus, reserve = res.eval_cpus, gpu, 0.0
        bundles = {"the trial actor": evaluation}
        describe = f"one actor of {_fmt(evaluation)} (resources.eval_cpus, resources.use_gpu)"
    if cpus + reserve > have_cpu + 1e-9 or gpus > have_gpu + 1e-9:
        raise SweepError(
            f"sweep {spec.name!r}: each trial needs {cpus + reserve:g} CPU and {gpus:g} GPU ({describe}), but the "
            f"cluster has {have_cpu:g} CPU and {have_gpu:g} GPU (ray.cluster_resources()); lower "
            f"resources.num_workers / cpus_per_worker / eval_cpus / use_gpu, or add nodes")
    for what, bundle in bundles.items():
        if nodes and not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v) for node in nodes):
            raise SweepError(f"sweep {spec.name!r}: {what} needs {_fmt(bundle)} on one node, but no node has that much "
                             f"(largest: {_fmt(max(nodes, key=lambda n: (n.get('GPU', 0), n.get('CPU', 0))))})")
    fits = [math.floor((have_cpu - reserve) / cpus + 1e-9)]
    if gpus:
        fits.append(math.floor(have_gpu / gpus + 1e-9))
    if res.max_concurrent_trials:
        fits.append(res.max_concurrent_trials)
    return TrialResources(use_gpu, actor, cpus, gpus, reserve, max(1, min(fits)), describe)


def _cluster() -> tuple[dict[str, float], list[dict[str, float]]]:
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return dict(ray.cluster_resources()), nodes


# -- driver-side resolution ------------------------------------------------------------------------

def sweep_dir(spec: SweepSpec, cfg: ExperimentConfig, out: str | Path | None) -> Path:
    return Path(out).resolve() if out else (cfg.run_dir / "sweeps" / spec.name).resolve()


def _absolute_target(cfg: ExperimentConfig) -> ExperimentConfig:
    model = cfg.target.model
    if Path(model).exists():
        model = str(Path(model).resolve())
    return cfg.model_copy(update={"target": cfg.target.model_copy(update={"model": model})})


def _identity(spec: SweepSpec, cfg: ExperimentConfig) -> dict:
    return json.loads(json.dumps({
        "spec": spec.model_dump(exclude={"presets", "num_samples", "resources"}),
        "experiment": {"name": cfg.name, "target": cfg.target.model, "data": cfg.data.model_dump(),
                       "train": cfg.train.model_dump(), "drafter": cfg.drafter.model_dump(), "tree": cfg.tree.model_dump()},
    }, default=str))


def _check_out(out: Path, spec: SweepSpec, cfg: ExperimentConfig, resume: bool) -> bool:
    """Whether to restore the Ray Tune state in ``out``. SweepError when ``out`` holds a sweep and
    ``resume`` is off, or holds one with other settings and ``resume`` is on. With ``resume`` and no
    saved Tune state (an empty folder, or a sweep killed before Tune saved anything) the sweep starts
    over, so a retried job can always pass ``--resume``."""
    from ray.tune import Tuner

    state = out / STATE_FILE
    tune_dir = out / TUNE_DIR
    restorable = tune_dir.is_dir() and Tuner.can_restore(str(tune_dir))
    if resume:
        if state.is_file():
            changed = changed_settings(json.loads(state.read_text()), _identity(spec, cfg))
            if changed:
                raise SweepError(f"{out}: settings changed since the sweep started ({describe_changes(changed)}); "
                                 f"resume with the same spec and config, or use another --out")
        if not restorable:
            print(f"taps sweep {spec.name}: nothing to resume in {out} (no saved Ray Tune state); starting the sweep",
                  flush=True)
        return restorable
    if restorable or state.is_file():
        raise SweepError(f"{out} already holds sweep results; pass --resume to continue that sweep, or --out to start "
                         f"another (nothing was overwritten)")
    return False


def _write_state(out: Path, spec: SweepSpec, cfg: ExperimentConfig) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / STATE_FILE, _identity(spec, cfg))
    except OSError as err:
        raise SweepError(f"output directory {str(out)!r} is not writable: {err.strerror or err}") from None


def _feature_sets(cfg: ExperimentConfig, fingerprint: dict, required: set[str]) -> dict:
    from taps_ray.data.features import FeatureCacheError, load_feature_sets

    unknown = sorted(required - set(cfg.data.datasets))
    if unknown:
        raise SweepError(f"the sweep names dataset(s) {unknown} that the experiment {cfg.name!r} does not define; "
                         f"datasets: {sorted(cfg.data.datasets)}")
    try:
        return load_feature_sets(cfg, fingerprint, required)
    except FeatureCacheError as err:
        raise SweepError(str(err)) from None


def _heldout_prompt(row: dict) -> list[int]:
    ids, mask = row["input_ids"], row["loss_mask"]
    first = int(mask.nonzero()[0, 0]) if bool(mask.any()) else len(ids)
    return ids[:first].tolist()


def resolve_prompts(spec: SweepSpec, cfg: ExperimentConfig, target, sets: dict, heldout_rows: int,
                    heldout_seed: int) -> dict[str, list[list[int]]]:
    """Held-out prompts of every domain as token ids (see :class:`~taps_ray.sweeps.config.PromptSpec`)."""
    import numpy as np

    from taps_ray.data.benchmarks import load_benchmark
    from taps_ray.data.mixtures import split_rows
    from taps_ray.eval.runner import conversation_ids

    prompts: dict[str, list[list[int]]] = {}
    for domain, p in spec.eval.prompts.items():
        if p.source == "heldout":
            fs = sets[p.dataset or domain]
            held, _ = split_rows(fs.rows, heldout_rows, heldout_seed)
            chosen = np.sort(np.random.default_rng(p.seed).permutation(held)[:p.limit])
            items = [_heldout_prompt(r) for r in fs.read_rows(chosen)]
            items = [ids for ids in items if ids]
        else:
            questions = load_benchmark(p.source, limit=p.limit, seed=p.seed)
            items = [conversation_ids(target, q.turns[:1], []).tolist() for q in questions]
        if not items:
            raise SweepError(f"eval.prompts.{domain}: no usable prompts from {p.source}")
        prompts[domain] = items
    return prompts


def check_interpolation_drafters(spec: InterpolationSweepSpec, target) -> dict[str, str]:
    """Absolute drafter sources; SweepError when a folder is no drafter, or when the drafters do not
    share one target (and shapes), or do not fit the experiment's target."""
    from taps_ray.models.drafter import WEIGHTS_NAME, read_drafter_meta
    from taps_ray.models.target import TargetFingerprint
    from taps_ray.sweeps.interpolation import RANDOM_PREFIX

    sources, metas = {}, {}
    for name, source in spec.drafters.items():
        if source.startswith(RANDOM_PREFIX):
            try:
                int(source[len(RANDOM_PREFIX):])
            except ValueError:
                raise SweepError(f"drafters.{name}: {source!r} must be random:SEED with an integer seed") from None
            sources[name] = source
            continue
        path = Path(source).resolve()
        if not (path / WEIGHTS_NAME).is_file():
            raise SweepError(f"drafters.{name}: {str(path)!r} is not a drafter checkpoint folder (no {WEIGHTS_NAME}); "
                             f"train it first (taps train) or use random:SEED")
        sources[name], metas[name] = str(path), read_drafter_meta(path)
    named = list(metas)
    for other in named[1:]:
        first = metas[named[0]]
        problem = TargetFingerprint(**first["target"]).mismatch(metas[other].get("target", {}))
        if problem:
            raise SweepError(f"drafters {named[0]!r} and {other!r} were trained for different targets ({problem}); "
                             f"only drafters of one target can be averaged")
        if first.get("drafter") != metas[other].get("drafter"):
            raise SweepError(f"drafters {named[0]!r} and {other!r} have different architectures; cannot average them")
    for name in named:
        problem = target.fingerprint.mismatch(metas[name].get("target", {}))
        if problem:
            raise SweepError(f"drafters.{name} was trained for another target than the experiment's: {problem}")
    vocab = {name: _draft_vocabulary(sources[name]) if name in metas else None for name in sources}
    if len({None if v is None else tuple(v) for v in vocab.values()}) > 1:
        sizes = {name: target.vocab_size if v is None else len(v) for name, v in vocab.items()}
        raise SweepError(f"the drafters use different draft vocabularies (sizes {sizes}); cannot average them")
    return sources


def _draft_vocabulary(folder: str) -> list[int] | None:
    """The draft -> target id map of a drafter checkpoint (None: the full vocabulary)."""
    from safetensors import safe_open

    from taps_ray.models.drafter import WEIGHTS_NAME

    with safe_open(str(Path(folder) / WEIGHTS_NAME), framework="pt") as f:
        return f.get_tensor("draft_to_target").tolist() if "draft_to_target" in f.keys() else None


# -- running ---------------------------------------------------------------------------------------

def _trial_dirname(trial) -> str:
    return trial.trial_id


def _describe_config(config: dict) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in config.items())


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ",".join(_short(v) for v in value) + "]"
    return str(value)


def _progress_callback(name: str, domains: list[str]):
    from ray.tune import Callback

    class Progress(Callback):
        """One line per trial event on stdout."""

        def on_trial_result(self, iteration, trials, trial, result, **info):
            head = f"taps sweep {name}: trial {trial.trial_id} ({_describe_config(trial.config)})"
            if result.get("evaluated"):
                taus = ", ".join(f"{d} {result.get(f'tau/{d}', math.nan):.3f}" for d in domains)
                print(f"{head} done in {result.get('wall_s', 0):.0f}s: tau {taus}; objective "
                      f"{result.get('objective', math.nan):.3f}", flush=True)
            elif "sim_objective" in result:
                sims = ", ".join(f"{d} {result.get(f'sim_tau/{d}', math.nan):.3f}" for d in domains)
                print(f"{head} epoch {result.get('epoch')}: simulated tau {sims}; sim. objective "
                      f"{result['sim_objective']:.3f}", flush=True)

        def on_trial_recover(self, iteration, trials, trial, **info):
            print(f"taps sweep {name}: trial {trial.trial_id} failed; retrying", flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):
            print(f"taps sweep {name}: trial {trial.trial_id} ({_describe_config(trial.config)}) failed", flush=True)

    return Progress()


def _quiet_tune() -> None:
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    for logger in ("ray.tune", "ray.train", "ray.air"):
        logging.getLogger(logger).setLevel(logging.ERROR)


def _trial_target(cfg: ExperimentConfig, use_gpu: bool) -> dict:
    """The target config trials load: on the CPU unless the trial holds a GPU."""
    target = cfg.target.model_dump()
    if not use_gpu and target["device"] == "auto":
        target["device"] = "cpu"
    return target


def _mixture_context(spec: MixtureSweepSpec, cfg: ExperimentConfig, out: Path, resources: TrialResources, target):
    import ray

    from taps_ray.data.mixtures import split_rows
    from taps_ray.sweeps.mixture import MixtureContext, trial_variant
    from taps_ray.train.launch import heldout_tables

    sim = {d: p.dataset or d for d, p in spec.eval.prompts.items()}
    sets = _feature_sets(cfg, target.fingerprint.to_dict(), set(spec.mixture.datasets) | set(sim.values()))
    try:
        probe_cfg, probe = trial_variant(spec, cfg, {}, resources.use_gpu)
    except ValueError as err:
        raise SweepError(f"mixture: {err}") from None
    train = probe_cfg.variant_train(probe)
    _check_mixtures(spec, sets, train.heldout_rows, train.heldout_seed)
    heldout = {n: split_rows(fs.rows, train.heldout_rows, train.heldout_seed)[0] for n, fs in sets.items()}
    weights = {"embed": target.embed_tokens.weight.detach().cpu(), "lm_head": target.lm_head.weight.detach().cpu()}
    return MixtureContext(
        spec=spec, cfg=cfg, sets=sets, vocab_size=target.vocab_size, eos_ids=target.eos_token_ids,
        target_config=target.config, fingerprint=target.fingerprint.to_dict(), target=_trial_target(cfg, resources.use_gpu),
        weights=ray.put(weights), heldout=ray.put(heldout_tables(sets, heldout)), sim_datasets=sim,
        prompts=resolve_prompts(spec, cfg, target, sets, train.heldout_rows, train.heldout_seed),
        tree=(spec.eval.tree or cfg.tree).model_dump(), out_dir=str(out), use_gpu=resources.use_gpu,
        threads=spec.resources.threads or max(1, int(spec.resources.cpus_per_worker)), fail=os.environ.get(faults.SWEEP_ENV))


def _interpolation_context(spec: InterpolationSweepSpec, cfg: ExperimentConfig, out: Path,
                           resources: TrialResources, target):
    from taps_ray.sweeps.interpolation import InterpolationContext

    drafters = check_interpolation_drafters(spec, target)
    datasets = {p.dataset or d for d, p in spec.eval.prompts.items() if p.source == "heldout"}
    sets = _feature_sets(cfg, target.fingerprint.to_dict(), datasets) if datasets else {}
    return InterpolationContext(
        spec=spec, target=_trial_target(cfg, resources.use_gpu), drafters=drafters,
        prompts=resolve_prompts(spec, cfg, target, sets, cfg.train.heldout_rows, cfg.train.heldout_seed),
        tree=(spec.eval.tree or cfg.tree).model_dump(), out_dir=str(out),
        threads=spec.resources.threads or max(1, int(spec.resources.eval_cpus)), fail=os.environ.get(faults.SWEEP_ENV))


def _trainable(spec: SweepSpec, cfg: ExperimentConfig, out: Path, resources: TrialResources, target) -> Any:
    """The Tune trainable with its context (``with_parameters``, everything resolved and checked on the
    driver) and the trial actor's resources (``with_resources``)."""
    from ray import tune

    if isinstance(spec, MixtureSweepSpec):
        from taps_ray.sweeps.mixture import mixture_trial

        trainable = tune.with_parameters(mixture_trial, context=_mixture_context(spec, cfg, out, resources, target))
    else:
        from taps_ray.sweeps.interpolation import interpolation_trial

        trainable = tune.with_parameters(interpolation_trial,
                                         context=_interpolation_context(spec, cfg, out, resources, target))
    return tune.with_resources(trainable, resources.actor)


def _check_mixtures(spec: MixtureSweepSpec, sets: dict, heldout_rows: int, heldout_seed: int) -> None:
    """Every grid/choice (or range end) of ``ratio`` x ``total`` must fit the training pools."""
    from taps_ray.config import MixtureConfig
    from taps_ray.data.mixtures import MixtureError, mixture_counts, split_rows

    pools = {n: fs.rows - heldout_rows for n, fs in sets.items()}
    for name, fs in sets.items():
        try:
            split_rows(fs.rows, heldout_rows, heldout_seed)
        except MixtureError as err:
            raise SweepError(f"dataset {name!r}: {err}") from None
    first, second = spec.mixture.datasets
    ratios = spec.search["ratio"].probes() if "ratio" in spec.search else [spec.mixture.ratio]
    totals = spec.search["total"].probes() if "total" in spec.search else [spec.mixture.total]
    for ratio in ratios:
        for total in totals:
            mix = MixtureConfig(ratio={first: float(ratio), second: 1.0 - float(ratio)}, total=total)
            try:
                mixture_counts(mix, pools)
            except MixtureError as err:
                key = "search.total" if "total" in spec.search else "mixture.total"
                raise SweepError(f"{key}: ratio {ratio:g} x total {total}: {err}") from None


def run_sweep(spec: SweepSpec, cfg: ExperimentConfig, out: str | Path | None = None, resume: bool = False,
              num_samples: int | None = None, target=None, callbacks: list | None = None) -> SweepSummary:
    """Run (or, with ``resume``, continue) the sweep ``spec`` over experiment ``cfg`` (see module docstring).

    ``target``: an already loaded :class:`TargetModel` (default: ``cfg.target`` on the CPU; the driver
    uses its tokenizer, fingerprint, embedding and LM head). ``callbacks``: extra Ray Tune callbacks (a
    resumed sweep keeps those of the run it continues: Tune restores its ``RunConfig``).
    Raises :class:`SweepError` for input problems before any trial starts. One process at a time
    writes a sweep folder (:func:`taps_ray.runstate.folder_lock`).
    """
    started = time.time()
    cfg = _absolute_target(cfg)
    out = sweep_dir(spec, cfg, out)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(folder_lock(out, "taps sweep"))
        except OSError as err:
            raise SweepError(f"output directory {str(out)!r} is not writable: {err.strerror or err}") from None
        return _sweep(spec, cfg, out, resume, num_samples, target, callbacks, started)


def _sweep(spec: SweepSpec, cfg: ExperimentConfig, out: Path, resume: bool, num_samples: int | None, target,
           callbacks: list | None, started: float) -> SweepSummary:
    """:func:`run_sweep` into ``out``, whose lock this process holds."""
    from ray import tune

    from taps_ray.ray_utils import init_ray
    from taps_ray.train.placement import remove_recorded

    init_ray()
    _quiet_tune()
    cluster, nodes = _cluster()
    resources = plan_resources(spec, cluster, nodes)
    resume = _check_out(out, spec, cfg, resume)
    if target is None:
        from taps_ray.models.target import TargetLoadError, TargetModel

        try:
            target = TargetModel.load(cfg.target.model_copy(update={"device": "cpu"}))
        except TargetLoadError as err:
            raise SweepError(str(err)) from None
    trainable = _trainable(spec, cfg, out, resources, target)
    _write_state(out, spec, cfg)
    print(f"taps sweep {spec.name}: {spec.kind} sweep of {_describe_search(spec)} -> {out}; per trial "
          f"{resources.describe}; up to {resources.max_concurrent} trial(s) at once", flush=True)
    run_callbacks = [_progress_callback(spec.name, spec.domains), *(callbacks or [])]
    if resume:
        tuner = tune.Tuner.restore(str(out / TUNE_DIR), trainable=trainable, resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
    else:
        scheduler = None
        if isinstance(spec, MixtureSweepSpec) and spec.scheduler.kind == "asha":
            from ray.tune.schedulers import ASHAScheduler

            scheduler = ASHAScheduler(time_attr="epoch", metric="sim_objective", mode="max",
                                      max_t=spec.max_epochs(), grace_period=spec.scheduler.grace_period,
                                      reduction_factor=spec.scheduler.reduction_factor)
        tuner = tune.Tuner(
            trainable,
            param_space=spec.param_space(),
            tune_config=tune.TuneConfig(num_samples=num_samples or spec.num_samples, scheduler=scheduler,
                                        max_concurrent_trials=resources.max_concurrent,
                                        reuse_actors=isinstance(spec, InterpolationSweepSpec),
                                        trial_dirname_creator=_trial_dirname, trial_name_creator=_trial_dirname),
            run_config=tune.RunConfig(name=TUNE_DIR, storage_path=str(out), verbose=0, callbacks=run_callbacks,
                                      failure_config=tune.FailureConfig(max_failures=spec.max_failures)),
        )
    grid = tuner.fit()
    reaped = remove_recorded(out / "trials")
    if reaped:
        log.info("sweep %s: removed %d placement group(s) left by stopped or failed trials", spec.name, reaped)
    statuses = {t.trial_id: t.status for t in tune.ExperimentAnalysis(str(out / TUNE_DIR)).trials}
    summary = SweepSummary(spec.name, spec.kind, out, spec.objective.describe(), spec.domains, list(spec.search),
                           collect_rows(grid, statuses, out), time.time() - started,
                           expected=(num_samples or spec.num_samples) * math.prod(
                               len(d.grid) for d in spec.search.values() if d.grid is not None))
    summary.best = best_row(summary.rows)
    write_outputs(summary, spec)
    return summary


def _describe_search(spec: SweepSpec) -> str:
    parts = []
    for key, dim in spec.search.items():
        values = dim.finite
        parts.append(f"{key} {dim.kind} {[_short(v) for v in values] if values else list(getattr(dim, dim.kind))}")
    return ", ".join(parts)


# -- results ---------------------------------------------------------------------------------------

def collect_rows(grid, statuses: dict[str, str], out: Path) -> list[TrialRow]:
    """One :class:`TrialRow` per trial of a Tune ``ResultGrid`` (``statuses``: trial id -> saved Tune
    status): ``ok`` (evaluated), ``stopped`` (stopped early by the scheduler), ``failed`` (after its
    retries) or ``unfinished`` (interrupted)."""
    rows = []
    for result in grid:
        trial_id = Path(result.path).name
        metrics = {k: v for k, v in (result.metrics or {}).items() if not isinstance(v, dict)}
        if result.error is not None:
            status, error = "failed", _error_line(result.error)
        elif metrics.get("evaluated"):
            status, error = "ok", None
        elif statuses.get(trial_id) == "TERMINATED":
            status, error = "stopped", None
        else:
            status, error = "unfinished", None
        config = {k: v for k, v in (result.config or {}).items()}
        rows.append(TrialRow(trial_id, status, config, metrics, count_attempts(out / "trials" / trial_id), error))
    return sorted(rows, key=lambda r: (json.dumps(r.config, sort_keys=True, default=str), r.trial_id))


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    cause = [line for line in text if "Error" in line or "Failure" in line]
    return (cause[-1] if cause else (text[-1] if text else type(error).__name__)).strip()[:200]


def best_row(rows: list[TrialRow]) -> TrialRow | None:
    """The evaluated trial with the highest objective (the first of equals)."""
    scored = [r for r in rows if r.status == "ok" and not math.isnan(r.objective)]
    return max(scored, key=lambda r: r.objective) if scored else None


def _columns(summary: SweepSummary) -> list[str]:
    cols = ["trial_id", "status", *summary.keys]
    if summary.kind == "mixture":
        cols += ["mixture", "rows"]
    cols += [f"tau/{d}" for d in summary.domains] + ["objective"]
    if summary.kind == "mixture":
        cols += [f"sim_tau/{d}" for d in summary.domains] + ["sim_objective", "epoch"]
    return cols + ["wall_s", "attempts", "drafter", "error"]


def _cell(row: TrialRow, column: str) -> Any:
    if column in ("trial_id", "status", "attempts", "error"):
        return getattr(row, column)
    if column in row.config:
        return row.config[column]
    return row.metrics.get(column)


def write_outputs(summary: SweepSummary, spec: SweepSpec) -> None:
    """``results.csv``, the plot and ``best.json`` into ``summary.out``."""
    columns = _columns(summary)
    path = summary.out / RESULTS
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(columns)
    for row in summary.rows:
        writer.writerow(["" if (v := _cell(row, c)) is None else json.dumps(v) if isinstance(v, list) else v
                         for c in columns])
    atomic_write(path, table.getvalue())
    summary.files["results"] = path
    plot = plot_results(summary, spec)
    if plot is not None:
        summary.files["plot"] = plot
    best = summary.best
    payload = None if best is None else {
        "trial_id": best.trial_id, "config": best.config, "objective": best.objective,
        "objective_kind": summary.objective, "tau": {d: best.metrics.get(f"tau/{d}") for d in summary.domains},
        "drafter": best.metrics.get("drafter"), "mixture": best.metrics.get("mixture")}
    write_json(summary.out / BEST, payload, default=str)
    summary.files["best"] = summary.out / BEST


def plot_results(summary: SweepSummary, spec: SweepSpec) -> Path | None:
    """Tau per domain (and the objective) of the evaluated trials against ``ratio`` or ``alpha``
    (against the trial otherwise); None when no trial was evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary.rows if r.status == "ok"]
    if not rows:
        return None
    key = next((k for k in ("ratio", "alpha") if k in summary.keys), None)
    if key is not None:
        rows = sorted(rows, key=lambda r: float(r.config[key]))
        xs = [float(r.config[key]) for r in rows]
    else:
        xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for domain in summary.domains:
        ax.plot(xs, [r.metrics.get(f"tau/{domain}", math.nan) for r in rows], "o-", label=f"tau {domain}")
    ax.plot(xs, [r.objective for r in rows], "k--", label=f"objective ({summary.objective})")
    if key == "ratio":
        first, second = spec.mixture.datasets
        ax.set_xlabel(f"share of {first} in the mixture ({first}:{second} = r:1-r)")
        name = "tau_vs_ratio.png"
    elif key == "alpha":
        first, second = list(spec.drafters)
        ax.set_xlabel(f"alpha (alpha * {first} + (1 - alpha) * {second})")
        name = "tau_vs_alpha.png"
    else:
        ax.set_xticks(xs, [_describe_config(r.config) for r in rows], rotation=30, ha="right", fontsize=7)
        name = "tau_per_trial.png"
    ax.set_ylabel("tau (acceptance length)")
    ax.set_title(f"{summary.name}: tau per domain on held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = summary.out / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def results_table(summary: SweepSummary) -> str:
    """Markdown table: config, per-domain tau, objective, wall time and status of every trial."""
    head = ["trial", *summary.keys] + (["mixture"] if summary.kind == "mixture" else [])
    head += [f"tau {d}" for d in summary.domains] + ["objective"]
    head += (["sim. objective", "epochs"] if summary.kind == "mixture" else []) + ["wall s", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(value, fmt: str = ".3f") -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(value, fmt)

    for r in summary.rows:
        m = r.metrics
        status = r.status if r.attempts <= 1 else f"{r.status} ({r.attempts} attempts)"
        if r.error:
            status += f": {r.error[:80]}"
        cells = [r.trial_id, *(_short(r.config.get(k)) for k in summary.keys)]
        cells += [str(m.get("mixture", "-"))] if summary.kind == "mixture" else []
        cells += [num(m.get(f"tau/{d}")) for d in summary.domains] + [num(m.get("objective"))]
        if summary.kind == "mixture":
            cells += [num(m.get("sim_objective")), str(m.get("epoch", "-"))]
        cells += [num(m.get("wall_s", m.get("time_total_s")), ".0f"), status]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(summary: SweepSummary) -> str:
    """The table, the best config and where everything was written."""
    lines = [results_table(summary), ""]
    if summary.best is not None:
        best = summary.best
        taus = ", ".join(f"{d} {best.metrics.get(f'tau/{d}', math.nan):.3f}" for d in summary.domains)
        lines.append(f"best config: {_describe_config(best.config)} (trial {best.trial_id}): {summary.objective} "
                     f"{best.objective:.3f} (tau {taus})")
        lines.append(f"best drafter: {best.metrics.get('drafter')}")
    else:
        lines.append("best config: none (no trial was evaluated)")
    if summary.failed:
        lines.append(f"{len(summary.failed)} trial(s) failed after their retries: "
                     + ", ".join(r.trial_id for r in summary.failed))
    if summary.unfinished:
        lines.append(f"interrupted: {summary.unfinished} of {max(summary.expected, len(summary.rows))} trial(s) did not "
                     f"finish; continue with: taps sweep ... --resume --out {summary.out}")
    lines.append("wrote " + ", ".join(str(p) for p in summary.files.values()) + f" in {summary.wall_s:.0f}s")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    """Arguments of ``taps sweep``."""
    parser.add_argument("spec", help="sweep spec YAML: tune/mixture.yaml or tune/interpolation.yaml")
    parser.add_argument("config", nargs="?", default=None,
                        help="experiment YAML (default: the spec's 'experiment', e.g. configs/demo.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the spec, e.g. resources.num_workers=2")
    parser.add_argument("--preset", default=None, help="a preset of the spec (e.g. quick)")
    parser.add_argument("--num-samples", type=int, default=None, help="samples per grid point (default: the spec's)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted sweep; finished trials are kept")
    parser.add_argument("--out", default=None, help="output folder (default: runs/<experiment>/sweeps/<name>)")
    parser.add_argument("--json", action="store_true", help="print the rows and the best trial as JSON")


def run_command(args) -> int:
    """``taps sweep``: 0 when every trial finished and one was evaluated, else 1."""
    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config and not Path(config).exists():
        overrides, config = [config, *overrides], None
    if args.num_samples is not None and args.num_samples < 1:
        raise SweepError(f"--num-samples must be >= 1, got {args.num_samples}")
    spec = load_spec(args.spec, args.preset, overrides)
    cfg = load_config(config or spec.experiment)
    summary = run_sweep(spec, cfg, args.out, resume=args.resume, num_samples=args.num_samples)
    if args.json:
        print(json.dumps({"rows": [vars(r) for r in summary.rows], "best": summary.best and vars(summary.best),
                          "files": {k: str(v) for k, v in summary.files.items()}}, indent=1, default=str))
    else:
        print(report(summary))
    sys.stdout.flush()
    return 0 if summary.best is not None and not summary.unfinished else 1

