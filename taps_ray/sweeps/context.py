"""What sweep trials need, resolved and checked on the driver before any trial starts.

Feature sets and held-out prompts (as token ids), the drafters an interpolation sweep averages, the
mixtures a mixture sweep trains on, and the per-kind trial context (:class:`~taps_ray.sweeps.mixture.
MixtureContext`, :class:`~taps_ray.sweeps.interpolation.InterpolationContext`) with the target's
embedding and LM head in the object store. Model, data and Ray code is imported inside the functions:
``taps sweep --help`` and the spec checks load none of it.
"""

from __future__ import annotations

import os
from pathlib import Path

from taps_ray.config import ExperimentConfig
from taps_ray.runtime import faults
from taps_ray.sweeps.config import InterpolationSweepSpec, MixtureSweepSpec, SweepError, SweepSpec
from taps_ray.sweeps.resources import TrialResources


def trial_algorithms(spec: MixtureSweepSpec) -> set[str]:
    """The algorithms a mixture sweep's trials may train: the base drafter's, and every value ``search.algorithm``
    lists (grid or choice)."""
    dimension = spec.search.get("algorithm")
    listed = (dimension.grid or dimension.choice or []) if dimension is not None else []
    return {spec.mixture.algorithm, *map(str, listed)}


def trial_features(spec: MixtureSweepSpec, cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with the feature sets its trials read: EAGLE-3's layers when a trial may train an eagle3 drafter
    (``data.features.layers: auto`` becomes ``eagle3``); SweepError when the config asks for the last hidden
    state alone, which an eagle3 trial cannot train on."""
    if "eagle3" not in trial_algorithms(spec):
        return cfg
    layers = cfg.data.features.layers
    if layers == "last":
        raise SweepError("the sweep trains eagle3 drafters, which read EAGLE-3's three target layers; the experiment "
                         "sets data.features.layers: last (use eagle3 or auto, and `taps prepare CONFIG "
                         "data.features.layers=eagle3`)")
    if layers == "eagle3":
        return cfg
    features = cfg.data.features.model_copy(update={"layers": "eagle3"})
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"features": features})})


def feature_sets(cfg: ExperimentConfig, fingerprint: dict, required: set[str]) -> dict:
    from taps_ray.data.feature_sets import FeatureCacheError, load_feature_sets

    unknown = sorted(required - set(cfg.data.datasets))
    if unknown:
        raise SweepError(f"the sweep names dataset(s) {unknown} that the experiment {cfg.name!r} does not define; "
                         f"datasets: {sorted(cfg.data.datasets)}")
    try:
        return load_feature_sets(cfg, fingerprint, required)
    except FeatureCacheError as err:
        hint = " with EAGLE-3's layers: `taps prepare CONFIG data.features.layers=eagle3`" \
            if cfg.data.features.layers == "eagle3" else ""
        raise SweepError(f"{err}{hint}") from None


def heldout_prompt(row: dict) -> list[int]:
    ids, mask = row["input_ids"], row["loss_mask"]
    first = int(mask.nonzero()[0, 0]) if bool(mask.any()) else len(ids)
    return ids[:first].tolist()


def resolve_prompts(spec: SweepSpec, cfg: ExperimentConfig, target, sets: dict, heldout_rows: int,
                    heldout_seed: int) -> dict[str, list[list[int]]]:
    """Held-out prompts of every domain as token ids (see :class:`~taps_ray.sweeps.config.PromptSpec`)."""
    import numpy as np

    from taps_ray.data.benchmarks import load_benchmark
    from taps_ray.data.mixtures import split_rows
    from taps_ray.eval.worker import conversation_ids

    prompts: dict[str, list[list[int]]] = {}
    for domain, p in spec.eval.prompts.items():
        if p.source == "heldout":
            fs = sets[p.dataset or domain]
            held, _ = split_rows(fs.rows, heldout_rows, heldout_seed)
            chosen = np.sort(np.random.default_rng(p.seed).permutation(held)[:p.limit])
            items = [heldout_prompt(r) for r in fs.read_rows(chosen)]
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
    from taps_ray.drafter_sources import random_drafter_seed
    from taps_ray.models.drafter import WEIGHTS_NAME, read_drafter_meta
    from taps_ray.models.target import TargetFingerprint

    sources, metas = {}, {}
    for name, source in spec.drafters.items():
        try:
            seed = random_drafter_seed(source)
        except ValueError:
            raise SweepError(f"drafters.{name}: {source!r} must be random:SEED with an integer seed") from None
        if seed is not None:
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
    vocab = {name: draft_vocabulary(sources[name]) if name in metas else None for name in sources}
    if len({None if v is None else tuple(v) for v in vocab.values()}) > 1:
        sizes = {name: target.vocab_size if v is None else len(v) for name, v in vocab.items()}
        raise SweepError(f"the drafters use different draft vocabularies (sizes {sizes}); cannot average them")
    return sources


def draft_vocabulary(folder: str) -> list[int] | None:
    """The draft -> target id map of a drafter checkpoint (None: the full vocabulary)."""
    from safetensors import safe_open

    from taps_ray.models.drafter import WEIGHTS_NAME

    with safe_open(str(Path(folder) / WEIGHTS_NAME), framework="pt") as f:
        return f.get_tensor("draft_to_target").tolist() if "draft_to_target" in f.keys() else None


def trial_target(cfg: ExperimentConfig, use_gpu: bool) -> dict:
    """The target config trials load: on the CPU unless the trial holds a GPU."""
    target = cfg.target.model_dump()
    if not use_gpu and target["device"] == "auto":
        target["device"] = "cpu"
    return target


def mixture_context(spec: MixtureSweepSpec, cfg: ExperimentConfig, out: Path, resources: TrialResources, target):
    import ray

    from taps_ray.data.mixtures import split_rows
    from taps_ray.sweeps.mixture import MixtureContext, trial_variant
    from taps_ray.train.variant import heldout_tables

    sim = {d: p.dataset or d for d, p in spec.eval.prompts.items()}
    sets = feature_sets(trial_features(spec, cfg), target.fingerprint.to_dict(),
                        set(spec.mixture.datasets) | set(sim.values()))
    try:
        probe_cfg, probe = trial_variant(spec, cfg, {}, resources.use_gpu)
    except ValueError as err:
        raise SweepError(f"mixture: {err}") from None
    train = probe_cfg.variant_train(probe)
    check_mixtures(spec, sets, train.heldout_rows, train.heldout_seed)
    heldout = {n: split_rows(fs.rows, train.heldout_rows, train.heldout_seed)[0] for n, fs in sets.items()}
    weights = {"embed": target.embed_tokens.weight.detach().cpu(), "lm_head": target.lm_head.weight.detach().cpu()}
    return MixtureContext(
        spec=spec, cfg=cfg, sets=sets, vocab_size=target.vocab_size, eos_ids=target.eos_token_ids,
        target_config=target.config, fingerprint=target.fingerprint.to_dict(), target=trial_target(cfg, resources.use_gpu),
        weights=ray.put(weights), heldout=ray.put(heldout_tables(sets, heldout)), sim_datasets=sim,
        prompts=resolve_prompts(spec, cfg, target, sets, train.heldout_rows, train.heldout_seed),
        tree=(spec.eval.tree or cfg.tree).model_dump(), out_dir=str(out), use_gpu=resources.use_gpu,
        threads=spec.resources.threads or max(1, int(spec.resources.cpus_per_worker)), fail=os.environ.get(faults.SWEEP_ENV))


def interpolation_context(spec: InterpolationSweepSpec, cfg: ExperimentConfig, out: Path,
                           resources: TrialResources, target):
    from taps_ray.sweeps.interpolation import InterpolationContext

    drafters = check_interpolation_drafters(spec, target)
    datasets = {p.dataset or d for d, p in spec.eval.prompts.items() if p.source == "heldout"}
    sets = feature_sets(cfg, target.fingerprint.to_dict(), datasets) if datasets else {}
    return InterpolationContext(
        spec=spec, target=trial_target(cfg, resources.use_gpu), drafters=drafters,
        prompts=resolve_prompts(spec, cfg, target, sets, cfg.train.heldout_rows, cfg.train.heldout_seed),
        tree=(spec.eval.tree or cfg.tree).model_dump(), out_dir=str(out),
        threads=spec.resources.threads or max(1, int(spec.resources.eval_cpus)), fail=os.environ.get(faults.SWEEP_ENV))


def check_mixtures(spec: MixtureSweepSpec, sets: dict, heldout_rows: int, heldout_seed: int) -> None:
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
