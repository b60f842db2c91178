"""``taps train``: one Ray Train ``TorchTrainer`` per drafter variant, all variants concurrently.

Each selected variant is planned and gets its trainer from :mod:`taps_ray.train.variant`. The target's
embedding and LM head (the only target weights a drafter needs) and the held-out rows go to the
object store once and are shared by all variants.

Concurrency: every ``trainer.fit()`` runs in its own (daemon) driver thread. In Ray Train V2,
``fit()`` starts a controller actor and blocks in ``ray.get`` on it (the GIL is released), and it
supports non-main threads (it only skips installing its SIGINT handler there), so the threads cost
nothing and the Datasets, the target-weight ObjectRef and the results stay in the driver. Ctrl-C
exits the driver, which takes its controller actors and their workers with it; the checkpoints
stay for ``--resume``. CPU workers get ``(cluster CPUs - 1) / workers`` logical CPUs each (one CPU
stays free for Ray Data's read tasks, which ask for a quarter CPU each) and the physical cores split
fairly as torch threads.

Outputs under ``<output_dir>/<name>/``: ``drafters/<variant>/`` (``config.json`` +
``model.safetensors`` of the final checkpoint, loadable by :meth:`DraftHead.load`;
``trained_prompts.json``, the prompt hashes of every feature set the mixture drew from, see
:mod:`taps_ray.data.contamination`; ``metrics.jsonl``; ``variant.json``), ``ray/<variant>/`` (Ray
Train checkpoints), ``train_summary.json``.
An existing variant is never overwritten silently: ``resume`` continues from its last checkpoint
(the settings must be unchanged), ``force`` deletes it first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from taps_ray.config import ExperimentConfig, VariantConfig
from taps_ray.data.feature_sets import FeatureCacheError, load_feature_sets
from taps_ray.runstate import changed_settings, describe_changes, folder_lock, write_json
from taps_ray.train.variant import (
    TrainLaunchError,
    VariantPlan,
    build_trainer,
    copy_final,
    heldout_tables,
    init_vocabularies,
    plan_variants,
)

log = logging.getLogger(__name__)

Mode = Literal["new", "resume", "force"]


@dataclass
class VariantResult:
    """Outcome of one variant: ``metrics`` are its last report (held-out metrics under ``heldout/``)."""

    variant: str
    algorithm: str
    mixture: str
    rows: int
    tokens: int
    epochs: int
    steps: int
    wall_s: float
    status: str = "ok"
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    drafter_dir: str | None = None
    started: float = 0.0
    finished: float = 0.0


@dataclass
class TrainSummary:
    """All variants of one ``taps train`` call (written to ``<run_dir>/train_summary.json``)."""

    run_dir: str
    wall_s: float
    variants: list[VariantResult]

    @property
    def failed(self) -> list[VariantResult]:
        return [v for v in self.variants if v.status == "failed"]

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "wall_s": round(self.wall_s, 2), "variants": [asdict(v) for v in self.variants]}


def select_variants(cfg: ExperimentConfig, names: list[str] | None) -> list[VariantConfig]:
    """The config's variants, or those named (in config order); unknown names are an error."""
    if not cfg.variants:
        raise TrainLaunchError("the config has no 'variants:' section; nothing to train")
    known = {v.name: v for v in cfg.variants}
    if names:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise TrainLaunchError(f"unknown variant(s) {unknown}; variants in config: {list(known)}")
        return [v for v in cfg.variants if v.name in set(names)]
    return list(cfg.variants)


def _writable_run_dir(cfg: ExperimentConfig) -> Path:
    run_dir = Path(cfg.output_dir, cfg.name).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_probe.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise TrainLaunchError(f"output directory {str(run_dir)!r} is not writable: {err.strerror or err}") from None
    return run_dir


def variant_record(cfg: ExperimentConfig, variant: VariantConfig) -> dict:
    """The settings a resumed run must share with the run it continues."""
    return {"variant": variant.model_dump(), "train": cfg.variant_train(variant).model_dump(),
            "objective": variant.objective_config().model_dump(),
            "mixture": cfg.mixtures[variant.mixture].model_dump(), "drafter": cfg.drafter.model_dump(),
            "target": cfg.target.model, "max_len": cfg.data.features.max_len}


def prepare_outputs(cfg: ExperimentConfig, run_dir: Path, variants: list[VariantConfig], mode: Mode
                     ) -> list[VariantConfig]:
    """Apply ``mode`` to existing variant outputs; return the variants left to train."""
    existing = [v for v in variants if (run_dir / "drafters" / v.name).exists() or (run_dir / "ray" / v.name).exists()]
    if existing and mode == "new":
        raise TrainLaunchError(
            f"{run_dir} already holds variant(s) {[v.name for v in existing]}; pass --resume to continue from "
            f"their last checkpoints or --force to retrain them from scratch (nothing was overwritten)")
    todo = []
    for variant in variants:
        out = run_dir / "drafters" / variant.name
        if mode == "force":
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(run_dir / "ray" / variant.name, ignore_errors=True)
        record = variant_record(cfg, variant)
        record_path = out / "variant.json"
        if mode == "resume" and record_path.exists():
            changed = changed_settings(json.loads(record_path.read_text()), record)
            if changed:
                raise TrainLaunchError(f"variant {variant.name!r}: settings changed since the run started "
                                       f"({describe_changes(changed)}); use --force to retrain")
            meta = out / "config.json"
            if meta.exists() and json.loads(meta.read_text()).get("training", {}).get("final"):
                log.info("variant %s is already trained; skipping", variant.name)
                continue
        out.mkdir(parents=True, exist_ok=True)
        write_json(record_path, record)
        todo.append(variant)
    return todo


def _resources(plans: list[VariantPlan]) -> tuple[bool, float, int]:
    """(use GPUs, CPUs per CPU worker, torch threads per CPU worker) for the concurrent variants."""
    import ray

    cluster = ray.cluster_resources()
    workers = sum(p.train.num_workers for p in plans)
    gpus = cluster.get("GPU", 0) > 0
    total, free = float(cluster.get("CPU", 1)), float(ray.available_resources().get("CPU", 0.0))
    cpus = free if 1.0 + 0.1 * workers <= free < total else total
    if cpus < total:
        print(f"taps train: {total - free:g} of the cluster's {total:g} CPUs are held by other work; "
              f"CPU workers share the {free:g} free", flush=True)
    cores = min(cpus, float(os.cpu_count() or 1)) if len(ray.nodes()) == 1 else cpus
    per_worker = max(0.1, round((cpus - 1.0) / workers, 2)) if cpus > 1 else cpus / workers
    threads = max(1, int(cores // workers))
    return gpus, per_worker, threads


def load_training_target(cfg: ExperimentConfig):
    """The target's embedding and LM head on the CPU (all the driver and the workers use of it)."""
    from taps_ray.models.target import TargetLoadError
    from taps_ray.models.target_head import load_target_head

    try:
        return load_target_head(cfg.target.model_copy(update={"device": "cpu"}))
    except TargetLoadError as err:
        raise TrainLaunchError(str(err)) from None


def run_training(cfg: ExperimentConfig, variant_names: list[str] | None = None, mode: Mode = "new",
                 target=None) -> TrainSummary:
    """Train the selected variants of ``cfg`` concurrently (see module docstring).

    ``target``: an already loaded :class:`TargetModel` or :class:`TargetHead` (default: the head of
    ``cfg.target`` on the CPU, :func:`load_target_head`; only its embedding, LM head, config and fingerprint
    are used). Raises :class:`TrainLaunchError` for
    input problems before anything is trained; a variant whose training fails is reported in the
    summary (``status`` failed) after the others finish. One process at a time trains into a run
    folder (:func:`taps_ray.runstate.folder_lock`); on a multi-node cluster the run folder must be storage
    every node shares (:func:`taps_ray.runtime.storage.check_shared_storage`, a :class:`TrainLaunchError` otherwise).
    """
    started = time.time()
    variants = select_variants(cfg, variant_names)
    run_dir = _writable_run_dir(cfg)
    with folder_lock(run_dir, "taps train"):
        return _train(cfg, variants, run_dir, mode, target, started)


def _train(cfg: ExperimentConfig, variants: list[VariantConfig], run_dir: Path, mode: Mode, target,
           started: float) -> TrainSummary:
    """:func:`run_training` in ``run_dir``, whose lock this process holds."""
    import ray

    from taps_ray.runtime.cluster import init_ray
    from taps_ray.runtime.storage import SharedStorageError, check_shared_storage

    target = target or load_training_target(cfg)
    fingerprint = target.fingerprint.to_dict()
    required = {d for v in variants for d in cfg.mixtures[v.mixture].ratio or cfg.mixtures[v.mixture].counts or {}}
    try:
        sets = load_feature_sets(cfg, fingerprint, required)
    except FeatureCacheError as err:
        raise TrainLaunchError(str(err)) from None
    init_vocab = init_vocabularies(cfg, variants, target.config, target.fingerprint)
    plans = plan_variants(cfg, variants, sets, target.vocab_size, target.eos_token_ids, init_vocab)
    todo = {v.name for v in prepare_outputs(cfg, run_dir, variants, mode)}
    plans = [p for p in plans if p.variant.name in todo]
    if not plans:
        print("taps train: all selected variants are already trained", flush=True)
        return _summarize(run_dir, [], time.time() - started)

    init_ray()
    try:
        check_shared_storage(run_dir, what="run directory")
    except SharedStorageError as err:
        raise TrainLaunchError(str(err)) from None
    embed = target.embed_tokens.weight.detach().cpu()
    head = target.lm_head.weight.detach().cpu()
    weights = ray.put({"embed": embed, "lm_head": head})
    del embed, head
    gpus, cpus, threads = _resources(plans)
    wants_gpus = [p.variant.name for p in plans if p.train.use_gpu is True]
    if wants_gpus and not gpus:
        print(f"taps train: {wants_gpus} ask for GPU workers (train.use_gpu: true) but the cluster has no GPU "
              f"yet; they wait for an autoscaler to add GPU nodes (use_gpu: auto trains on CPUs)",
              file=sys.stderr, flush=True)
    heldout: dict[tuple, ray.ObjectRef] = {}
    for p in plans:
        key = (p.train.heldout_rows, p.train.heldout_seed)
        if key not in heldout:
            heldout[key] = ray.put(heldout_tables(sets, p.heldout))
    trainers = {p.variant.name: build_trainer(cfg, p, run_dir, sets, weights,
                                               heldout[(p.train.heldout_rows, p.train.heldout_seed)],
                                               target.config, fingerprint, gpus, cpus, threads) for p in plans}
    print(f"taps train: {len(plans)} variant(s) concurrently -> {run_dir} "
          f"({'GPU' if gpus else f'{cpus:g} CPU / {threads} thread(s)'} per worker)", flush=True)

    results = _fit_concurrently(plans, trainers, run_dir)
    return _summarize(run_dir, [results[p.variant.name] for p in plans], time.time() - started)


def _fit_concurrently(plans: list[VariantPlan], trainers: dict, run_dir: Path) -> dict[str, VariantResult]:
    """Each plan's :func:`_fit` on its trainer (``trainers``: by variant name), one thread per plan; the results by
    variant name. Ctrl-C exits with status 130, keeping the checkpoints for ``--resume``."""
    results: dict[str, VariantResult] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(
                   p.variant.name, _fit(p, trainers[p.variant.name], run_dir)), daemon=True)
               for p in plans]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=1.0)
    except KeyboardInterrupt:
        print(f"taps train: interrupted; checkpoints are kept in {run_dir / 'ray'}, continue with --resume",
              file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    return results


def _fit(plan: VariantPlan, trainer, run_dir: Path) -> VariantResult:
    """Fit one variant's ``trainer`` (in this thread) and copy its final drafter; a failure is the
    result's status, never raised, so it cannot stop the other variants."""
    name = plan.variant.name
    epochs = plan.train.epochs + (plan.train.stage2.epochs if plan.train.stage2 else 0)
    steps = epochs * math.ceil((plan.rows // plan.train.num_workers) / plan.train.batch_size)
    result = VariantResult(name, plan.variant.algorithm, plan.variant.mixture, plan.rows, plan.tokens,
                           epochs, steps, 0.0, started=time.time())
    threading.current_thread().name = f"train-{name}"
    try:
        fitted = trainer.fit()
        out = run_dir / "drafters" / name
        copy_final(fitted.checkpoint, out)
        result.metrics = dict(fitted.metrics or {})
        result.drafter_dir = str(out)
    except Exception as err:  # a failed variant must not stop the others
        result.status, result.error = "failed", f"{type(err).__name__}: {err}"
        log.error("variant %s failed: %s", name, result.error)
    result.finished = time.time()
    result.wall_s = result.finished - result.started
    print(f"taps train: {name} {result.status} in {result.wall_s:.0f}s", flush=True)
    return result


def _summarize(run_dir: Path, results: list[VariantResult], wall_s: float) -> TrainSummary:
    """This call's summary; ``train_summary.json`` also keeps earlier entries of variants not run now."""
    summary = TrainSummary(str(run_dir), wall_s, results)
    record = summary.to_dict()
    path = run_dir / "train_summary.json"
    if path.exists():
        ran = {r.variant for r in results}
        earlier = json.loads(path.read_text()).get("variants", [])
        record["variants"] = [v for v in earlier if v.get("variant") not in ran] + record["variants"]
    write_json(path, record, default=float)
    return summary


def summary_table(summary: TrainSummary) -> str:
    """Markdown table: one row per variant with held-out accuracy per draft position and tau."""
    depth = max([sum(1 for k in r.metrics if k.startswith("heldout/acc")) for r in summary.variants] or [0])
    domains = sorted({k.split("/")[1] for r in summary.variants for k in r.metrics
                      if k.startswith("heldout/") and k.count("/") == 2})
    head = (["variant", "algorithm", "mixture", "rows", "tokens", "epochs", "steps", "final loss"]
            + [f"acc@{k}" for k in range(1, depth + 1)] + ["sim. tau"] + [f"tau {d}" for d in domains]
            + ["tok/s/worker", "wall s", "status"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(value, fmt: str) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    for r in summary.variants:
        m = r.metrics
        cells = ([r.variant, r.algorithm, r.mixture, str(r.rows), str(r.tokens), str(r.epochs),
                  str(m.get("step", r.steps)), num(m.get("loss"), ".4f")]
                 + [num(m.get(f"heldout/acc{k}"), ".3f") for k in range(1, depth + 1)]
                 + [num(m.get("heldout/tau"), ".3f")] + [num(m.get(f"heldout/{d}/tau"), ".3f") for d in domains]
                 + [num(m["tokens"] / m["train_seconds"] if m.get("train_seconds") else None, ".0f"),
                    f"{r.wall_s:.0f}", r.status if not r.error else f"{r.status}: {r.error[:80]}"])
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\nwall time {summary.wall_s:.0f}s; outputs in {summary.run_dir}")
    return "\n".join(lines)

