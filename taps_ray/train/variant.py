"""One drafter variant: its plan (held-out split, mixture rows, draft vocabulary) and its Ray Train
``TorchTrainer``; ``taps train`` (:mod:`taps_ray.train.launch`) and the mixture sweep trial share them.

The plan holds the held-out split of every prepared dataset (``heldout_rows``, ``heldout_seed``), the
mixture's row selection over the training pools and an optional reduced draft vocabulary. The
trainer's workers read the selected feature rows from the cache's Parquet row groups, in a seeded
block order, each its own slice (:mod:`taps_ray.train.shards`); it has its own ``ScalingConfig`` and
``RunConfig(storage_path=<run_dir>/ray, name=<variant>, FailureConfig(max_failures))``. A variant's
final drafter records ``trained_prompts.json``, the prompt hashes of every feature set its mixture
drew from (:mod:`taps_ray.data.contamination`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from taps_ray.config import ExperimentConfig, TrainConfig, VariantConfig
from taps_ray.data.contamination import FEATURE_PROMPTS, TRAINED_PROMPTS, trained_prompts_record
from taps_ray.data.feature_sets import FeatureSet
from taps_ray.data.mixtures import MixtureError, MixtureSelection, select_mixture, split_rows
from taps_ray.drafter_sources import absolute_drafter_spec
from taps_ray.runstate import atomic_copy
from taps_ray.runtime import faults
from taps_ray.train.loop import DRAFTER_DIR, train_loop_per_worker
from taps_ray.train.shards import FEATURE_COLUMNS, plan_blocks
from taps_ray.train.vocab import coverage, draft_vocabulary, token_counts
from taps_ray.train.worker_config import WorkerConfig

log = logging.getLogger(__name__)

CACHE_BYTES = 2 * 1024**3


class TrainLaunchError(ValueError):
    """A ``taps train`` input problem (printed as one line by the CLI)."""


@dataclass
class VariantPlan:
    """Everything one variant's trainer needs, computed on the driver."""

    variant: VariantConfig
    train: TrainConfig
    selection: MixtureSelection
    heldout: dict[str, np.ndarray]
    rows: int
    tokens: int
    draft_to_target: list[int] | None = None
    vocab_coverage: float | None = None


def _row_tokens(fs: FeatureSet, row_ids: np.ndarray) -> int:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(fs.shard_paths(), columns=["row_id", "length"])
    keep = pc.is_in(table["row_id"], value_set=pa.array(np.asarray(row_ids, dtype=np.int64)))
    return int(pc.sum(table.filter(keep)["length"]).as_py() or 0)


def init_vocabularies(cfg: ExperimentConfig, variants: list[VariantConfig], target_config,
                      fingerprint) -> dict[str, list[int] | None]:
    """``train.init_from`` -> the draft vocabulary of that drafter (None: the full vocabulary), for the
    variants that start from one; loading each here checks it early (a folder, ``release:NAME``, this
    target's)."""
    from taps_ray.models.drafter import DrafterLoadError, DraftHead

    found: dict[str, list[int] | None] = {}
    for variant in variants:
        source = cfg.variant_train(variant).init_from
        if source is None or source in found:
            continue
        try:
            head = DraftHead.load(source, target_config, fingerprint)
        except DrafterLoadError as err:
            raise TrainLaunchError(f"variant {variant.name!r}: train.init_from: {err}") from None
        found[source] = None if head.draft_to_target is None else head.draft_to_target.tolist()
    return found


def plan_variants(cfg: ExperimentConfig, variants: list[VariantConfig], sets: dict[str, FeatureSet],
                  vocab_size: int, eos_ids: frozenset[int],
                  init_vocab: dict[str, list[int] | None] | None = None) -> list[VariantPlan]:
    """Held-out splits, mixture selections and draft vocabularies of ``variants`` (a variant with
    ``train.init_from`` keeps that drafter's vocabulary, ``init_vocab[init_from]``)."""
    plans = []
    for variant in variants:
        train = cfg.variant_train(variant)
        splits = {n: split_rows(fs.rows, train.heldout_rows, train.heldout_seed) for n, fs in sets.items()}
        pools = {n: pool for n, (_, pool) in splits.items()}
        try:
            selection = select_mixture(variant.mixture, cfg.mixtures[variant.mixture], pools)
        except MixtureError as err:
            raise TrainLaunchError(f"variant {variant.name!r}, mixture {variant.mixture!r}: {err}") from None
        plan = VariantPlan(variant=variant, train=train, selection=selection,
                           heldout={n: held for n, (held, _) in splits.items()}, rows=selection.total,
                           tokens=sum(_row_tokens(sets[n], ids) for n, ids in selection.rows.items()))
        size = cfg.drafter.draft_vocab_size
        if train.init_from is not None:
            kept = (init_vocab or {})[train.init_from]
            if kept is not None:
                import torch

                own = token_counts([(sets[n].shard_paths(), ids_) for n, ids_ in selection.rows.items()], vocab_size)
                plan.draft_to_target, plan.vocab_coverage = kept, coverage(own, torch.tensor(kept))
        elif size is not None:
            if train.vocab_source == "mixture":
                counted = [(sets[n].shard_paths(), ids) for n, ids in selection.rows.items()]
            else:
                counted = [(fs.shard_paths(), pools[n]) for n, fs in sets.items()]
            counts = token_counts(counted, vocab_size)
            ids = draft_vocabulary(counts, min(size, vocab_size), eos_ids)
            own = token_counts([(sets[n].shard_paths(), ids_) for n, ids_ in selection.rows.items()], vocab_size)
            plan.draft_to_target = ids.tolist()
            plan.vocab_coverage = coverage(own, ids)
        plans.append(plan)
    return plans


def heldout_tables(sets: dict[str, FeatureSet], rows: dict[str, np.ndarray]) -> dict:
    """Held-out feature rows per dataset as pyarrow Tables with a ``dataset`` column (read on the driver,
    only those rows: :meth:`FeatureSet.read_table`)."""
    import pyarrow as pa

    tables = {name: sets[name].read_table(ids, FEATURE_COLUMNS) for name, ids in sorted(rows.items()) if len(ids)}
    return {name: table.append_column("dataset", pa.array([name] * table.num_rows, type=pa.string()))
            for name, table in tables.items()}


def copy_final(checkpoint, out: Path) -> None:
    """Copy the checkpoint's drafter files (and its ``trained_prompts.json``, when it has one; a stale
    one in ``out`` is removed otherwise) into ``out`` atomically, file by file; ``config.json``, which
    says whether training is final, comes last."""
    with checkpoint.as_directory() as directory:
        source = Path(directory) / DRAFTER_DIR
        for name in ("model.safetensors", TRAINED_PROMPTS, "config.json"):
            if name == TRAINED_PROMPTS and not (source / name).is_file():
                (out / name).unlink(missing_ok=True)
                continue
            atomic_copy(source / name, out / name)


def trained_prompts(sets: dict[str, FeatureSet], selection: MixtureSelection) -> dict:
    """The ``trained_prompts.json`` record of a mixture: the union of the prompt hashes of every feature
    set it selects rows from (a feature set without recorded prompts is logged and left out)."""
    hashes: set[str] = set()
    sources = []
    for name, ids in sorted(selection.rows.items()):
        if len(ids) == 0:
            continue
        recorded = sets[name].prompt_hashes()
        if recorded is None:
            log.warning("features of %r at %s record no prompts (%s); run `taps prepare` to add them, else "
                        "evaluation cannot exclude what this drafter saw of %r", name, sets[name].path,
                        FEATURE_PROMPTS, name)
            continue
        hashes.update(recorded)
        sources.append(f"{name}: {sets[name].manifest.get('origin')}")
    return trained_prompts_record(hashes, sources)


def build_trainer(cfg: ExperimentConfig, plan: VariantPlan, run_dir: Path, sets: dict[str, FeatureSet],
                   weights, heldout, target_config, fingerprint: dict, gpus_present: bool, cpus: float,
                   threads: int, callbacks: list | None = None):
    """The ``TorchTrainer`` of one planned variant (``callbacks``: Ray Train ``UserCallback``s, e.g. a
    Tune report callback when a sweep trial drives it)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig

    variant, train = plan.variant, plan.train
    use_gpu = gpus_present if train.use_gpu == "auto" else bool(train.use_gpu)
    resources = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": cpus}
    worker_threads = train.threads or (4 if use_gpu else threads)
    out = run_dir / "drafters" / variant.name
    worker = WorkerConfig(
        variant=variant.name,
        objective=variant.objective_config(),
        train=train,
        target_config=target_config,
        fingerprint=fingerprint,
        weights=weights,
        draft_to_target=plan.draft_to_target,
        drafter_seed=cfg.drafter.seed,
        init_from=None if train.init_from is None else absolute_drafter_spec(train.init_from),
        train_rows=plan.rows,
        datasets=sorted(plan.selection.rows),
        blocks=plan_blocks({n: sets[n].shard_paths() for n in plan.selection.rows}, plan.selection.rows, train.seed),
        heldout=heldout,
        cache_rows=plan.tokens * target_config.hidden_size * 2 * (4 if variant.algorithm == "eagle3" else 1)
                   / train.num_workers <= CACHE_BYTES,
        metrics_path=str(out / "metrics.jsonl"),
        threads=worker_threads,
        fail_at_step=os.environ.get(faults.TRAIN_ENV),
        trained_prompts=trained_prompts(sets, plan.selection),
        meta={
            "variant": variant.name,
            "mixture": {"name": variant.mixture, "counts": plan.selection.counts,
                        "describe": plan.selection.describe()},
            "data": {n: {"origin": sets[n].manifest.get("origin"), "rows": int(ids.size),
                         "features": str(sets[n].path)} for n, ids in plan.selection.rows.items()},
            "draft_vocab": None if plan.draft_to_target is None else {
                "size": len(plan.draft_to_target), "source": train.vocab_source,
                "coverage": round(plan.vocab_coverage or 0.0, 5)},
            "experiment": cfg.name,
            **({"init_from": train.init_from} if train.init_from else {}),
        },
    )
    return _trainer_class()(
        train_loop_per_worker,
        train_loop_config={"worker": worker},
        scaling_config=ScalingConfig(num_workers=train.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(name=variant.name, storage_path=str(run_dir / "ray"),
                             failure_config=FailureConfig(max_failures=train.max_failures), callbacks=callbacks,
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             logging_config=LoggingConfig(log_level="ERROR")),
    )


def _trainer_class():
    """``TorchTrainer`` whose placement-group cleaner pings the controller instead of asking the
    state API, which needs a dashboard (see :mod:`taps_ray.runtime.placement`), and which starts no
    ``DatasetManager`` (its workers read the feature cache themselves, no Ray Dataset)."""
    from ray.train.torch import TorchTrainer

    from taps_ray.runtime.placement import ReaperCallback
    from taps_ray.runtime.ray_compat import trainer_with_taps_default_callbacks

    return trainer_with_taps_default_callbacks(TorchTrainer, ReaperCallback, "DrafterTrainer")
