"""``taps adapt``: a new drafter version fine-tuned on captured serving traffic mixed with its original data.

:func:`adapt_experiment` turns the experiment into a one-variant training run: dataset ``traffic`` (a
``{kind: features}`` source on the capture folder, :mod:`taps_ray.data.capture`), mixture ``adapt``
(``ratio``: ``traffic_share`` of the rows from the traffic, the rest split evenly over the source
drafter's original datasets, against forgetting; ``total``: ``adapt.rows``) and variant ``adapt-vN``
(the source's algorithm and objective, ``train.init_from`` = the source). ``new`` trains a fresh specialist
on the traffic alone. An EAGLE-3 source reads three target layers that serving does not capture: it trains on
a copy of the traffic with them recomputed teacher forced (:func:`~taps_ray.data.capture.with_feature_layers`),
deleted once the version is scored. :func:`run_adapt` trains it with :func:`~taps_ray.train.launch.run_training` into the
experiment's run folder, then scores the source (before) and the new drafter (after), on the traffic,
the source's own datasets and every other prepared dataset of the experiment (:func:`gate_domains`,
``guarded`` in the record: the gate must not let a version lose another served drafter's domain either),
with the trainer's held-out evaluation (:func:`~taps_ray.train.loop.evaluate`: simulated tau from greedy unrolled top-1
accuracy, not decoding) on the same held-out rows of the traffic and of each original dataset
(``train.heldout_rows``, ``heldout_seed``: never trained on). The version folder's ``config.json`` gains
``version``, ``parent`` and ``adapt`` (traffic rows used, tau before / after per domain); ``README.md`` is
its model card.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from taps_ray.config import ExperimentConfig, ObjectiveConfig, VariantConfig
from taps_ray.data.capture import TRAFFIC
from taps_ray.runstate import atomic_copy, write_json

log = logging.getLogger(__name__)

MIXTURE = "adapt"
ADAPTABLE = ("eagle2", "hass", "eagle3")
VERSION_PREFIX = "adapt-v"
TAU_KIND = ("simulated tau (1 + sum of the greedy unrolled top-1 accuracies' products over train.eval_depth draft "
            "positions) on held-out feature rows, as taps train reports it; not measured by decoding")


class AdaptError(ValueError):
    """A ``taps adapt`` input problem (printed as one line by the CLI)."""


@dataclass
class AdaptResult:
    """The new version: its folder, number and the ``adapt`` record of its ``config.json``."""

    out: Path
    version: int
    record: dict


def check_share(share: float) -> float:
    if not 0.0 <= share <= 1.0:
        raise AdaptError(f"the traffic share must be in [0, 1] (0: original data only, 1: traffic only), got {share}")
    return float(share)


def open_traffic(folder: str | Path, fingerprint: dict):
    """The capture folder as a feature set of this target; :class:`AdaptError` naming what is wrong."""
    from taps_ray.data.feature_sets import FeatureCacheError, open_feature_set

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise AdaptError(f"traffic folder {str(path)!r} does not exist; give a serving capture folder "
                         f"(serve.capture.dir)")
    try:
        return open_feature_set(path, fingerprint, TRAFFIC)
    except FeatureCacheError as err:
        raise AdaptError(f"traffic folder {str(path)!r}: {err}") from None


def original_datasets(cfg: ExperimentConfig, meta: dict) -> list[str]:
    """The source drafter's training datasets (its ``config.json`` ``data``) that the experiment defines;
    all the experiment's datasets when the source records none."""
    trained = [n for n in meta.get("data") or {} if n != TRAFFIC]
    known = [n for n in trained if n in cfg.data.datasets]
    if trained and not known:
        raise AdaptError(f"the drafter trained on dataset(s) {trained}, none of which the config defines "
                         f"(datasets: {sorted(cfg.data.datasets)})")
    if len(known) < len(trained):
        log.warning("adapt: the config lacks the drafter's dataset(s) %s; mixing in %s only",
                    sorted(set(trained) - set(known)), known)
    return known or [n for n in cfg.data.datasets if n != TRAFFIC]


def gate_domains(originals: list[str], prepared) -> list[str]:
    """The domains the before / after tau is taken on: the traffic, the source's own datasets, then every
    other prepared dataset of the experiment (the domains the other served drafters cover, which a
    version must not lose either); each only when its features are in ``prepared``."""
    own = [n for n in originals if n in prepared and n != TRAFFIC]
    return [TRAFFIC, *own, *(n for n in prepared if n != TRAFFIC and n not in own)]


def next_version(run_dir: Path, meta: dict) -> int:
    """One above the source's ``version`` and every ``adapt-vN`` already in the run folder."""
    taken = [int(m.group(1)) for p in (run_dir / "drafters").glob(f"{VERSION_PREFIX}*")
             if (m := re.fullmatch(rf"{VERSION_PREFIX}(\d+)", p.name))]
    parent = meta.get("version")
    return max([parent if isinstance(parent, int) else 0, *taken]) + 1


def adapt_experiment(cfg: ExperimentConfig, traffic: Path, source: str, meta: dict, share: float, new: bool,
                     version: int) -> tuple[ExperimentConfig, VariantConfig]:
    """The experiment with dataset ``traffic``, mixture ``adapt`` and the one variant ``adapt-vN``."""
    originals = [] if new else original_datasets(cfg, meta)
    if not new and share < 1.0 and not originals:
        raise AdaptError(f"a traffic share of {share} mixes in original data but the config defines no dataset "
                         f"besides traffic; use share 1 or --new")
    ratio = {TRAFFIC: 1.0} if new else {TRAFFIC: share, **{n: (1.0 - share) / len(originals) for n in originals}}
    raw = cfg.model_dump()
    raw["data"]["datasets"][TRAFFIC] = {"domain": TRAFFIC, "alternatives": [{"kind": "features", "path": str(traffic)}]}
    raw["mixtures"][MIXTURE] = {"ratio": ratio, "total": cfg.adapt.rows}
    algorithm = meta.get("algorithm") if meta.get("algorithm") in ADAPTABLE else "eagle2"
    objective = {k: v for k, v in (meta.get("objective") or {}).items()
                 if k in ObjectiveConfig.model_fields and k != "algorithm"}
    variant = {"name": f"{VERSION_PREFIX}{version}", "mixture": MIXTURE, "algorithm": "eagle2" if new else algorithm,
               "objective": {} if new else objective, "train": {} if new else {"init_from": source}}
    raw["variants"] = [variant]
    adapted = ExperimentConfig.model_validate(raw)
    return adapted, adapted.variants[0]


def heldout_tau(module, cfg: ExperimentConfig, variant: VariantConfig, sets: dict, target) -> dict[str, float]:
    """Simulated tau of ``module`` per dataset of ``sets`` on its held-out rows (the trainer's split)."""
    import torch

    from taps_ray.data.mixtures import split_rows
    from taps_ray.train.batches import heldout_rows
    from taps_ray.train.loop import evaluate
    from taps_ray.train.variant import heldout_tables

    train = cfg.variant_train(variant)
    held = {n: split_rows(fs.rows, train.heldout_rows, train.heldout_seed)[0] for n, fs in sets.items()}
    embed, head = target.embed_tokens.weight.detach().cpu(), target.lm_head.weight.detach().cpu()
    rows = heldout_rows(heldout_tables(sets, held), int(embed.shape[1]), module.row_layers)
    metrics = evaluate(module.float().eval(), rows, embed, head, variant.objective_config(), train.eval_depth,
                       train.batch_size, int(embed.shape[1]), [], torch.device("cpu"))
    return {n: round(float(metrics[f"heldout/{n}/tau"]), 4) for n in rows}


def _eagle3_traffic(cfg: ExperimentConfig, traffic: Path, target, version: int) -> Path:
    """A copy of the captured ``traffic`` (last hidden state only) with the three EAGLE-3 layers and the
    last recomputed teacher forced, under ``<run>/adapt/``; the caller deletes it."""
    from taps_ray.data.capture import with_feature_layers
    from taps_ray.data.feature_sets import EAGLE3
    from taps_ray.models.target import TargetModel

    forward = target if isinstance(target, TargetModel) else TargetModel.load(cfg.target)
    return with_feature_layers(traffic, cfg.run_dir / "adapt" / f"{VERSION_PREFIX}{version}-traffic", forward, EAGLE3)


def run_adapt(cfg: ExperimentConfig, traffic: str | Path, source: str, share: float | None = None,
              new: bool = False, out: str | Path | None = None, target=None) -> AdaptResult:
    """Train the next version of ``source`` on the traffic of ``traffic`` (see module docstring);
    ``share`` overrides ``adapt.traffic_share``; ``out``: also copy the version folder there."""
    from taps_ray.data.feature_sets import load_feature_sets
    from taps_ray.drafter_sources import absolute_drafter_spec
    from taps_ray.models.drafter import DrafterLoadError, DraftHead
    from taps_ray.train.launch import load_training_target, run_training

    if new and share is not None and share != 1.0:
        raise AdaptError(f"--new trains on the traffic only; a traffic share of {share} does not apply (leave it out)")
    share = check_share(cfg.adapt.traffic_share if share is None else share)
    source = absolute_drafter_spec(source)
    target = target or load_training_target(cfg)
    fingerprint = target.fingerprint
    try:
        parent = DraftHead.load(source, target.config, fingerprint)
    except DrafterLoadError as err:
        raise AdaptError(f"--drafter: {err}") from None
    meta = dict(parent.metadata or {})
    traffic_set = open_traffic(traffic, fingerprint.to_dict())
    held = cfg.train.heldout_rows
    if traffic_set.rows <= held:
        raise AdaptError(f"traffic folder {str(traffic_set.path)!r} has {traffic_set.rows} row(s); adapt holds out "
                         f"train.heldout_rows={held} of them for the before/after tau, so it needs more than {held}")
    version = next_version(cfg.run_dir, meta)
    eagle3 = meta.get("algorithm") == "eagle3" and not new
    layered = _eagle3_traffic(cfg, traffic_set.path, target, version) if eagle3 else None
    try:
        adapted, variant = adapt_experiment(cfg, layered or traffic_set.path, source, meta, share, new, version)
        summary = run_training(adapted, [variant.name], target=target)
        result = summary.variants[0]
        if result.status != "ok":
            raise AdaptError(f"training {variant.name} failed: {result.error}")
        folder = Path(result.drafter_dir)
        sets = load_feature_sets(adapted, fingerprint.to_dict(), {TRAFFIC})
        originals = original_datasets(cfg, meta)
        domains = gate_domains(originals, sets)
        before = heldout_tau(parent, adapted, variant, sets, target)
        after = heldout_tau(DraftHead.load(folder, target.config, fingerprint), adapted, variant, sets, target)
    finally:
        if layered is not None:
            shutil.rmtree(layered, ignore_errors=True)
    written = json.loads((folder / "config.json").read_text())
    counts = written["mixture"]["counts"]
    record = {"traffic": str(traffic_set.path), "traffic_rows": int(counts.get(TRAFFIC, 0)),
              **({"traffic_layers": "recomputed teacher forced: the three EAGLE-3 layers and the last"}
                 if layered is not None else {}),
              "traffic_rows_captured": traffic_set.rows, "traffic_share": 1.0 if new else share, "new": new,
              "rows": counts, "heldout_rows": adapted.variant_train(variant).heldout_rows,
              "guarded": [n for n in domains[1:] if n not in originals],
              "tau": {n: {"before": before[n], "after": after[n]} for n in domains}, "tau_kind": TAU_KIND}
    write_json(folder / "config.json", {**written, "version": version, "parent": source, "adapt": record})
    (folder / "README.md").write_text(model_card(variant.name, version, source, record, written))
    return AdaptResult(out=_copy_version(folder, out), version=version, record=record)


def _copy_version(folder: Path, out: str | Path | None) -> Path:
    """``folder``'s files (but ``variant.json``) copied into ``out``, which is returned; ``folder`` itself
    when ``out`` is None."""
    if out is None:
        return folder
    target_dir = Path(out)
    target_dir.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.is_file() and item.name != "variant.json":
            atomic_copy(item, target_dir / item.name)
    return target_dir


def model_card(name: str, version: int, parent: str, record: dict, meta: dict) -> str:
    """The version folder's ``README.md``: lineage, data, and tau before / after per domain."""
    start = "a fresh drafter (a new traffic specialist)" if record["new"] else f"`{parent}`"
    lines = [f"# {name} (version {version})", "",
             f"Drafter adapted by `taps adapt` from {start} to captured serving traffic.", "",
             f"- parent: `{parent}`",
             f"- traffic: `{record['traffic']}` ({record['traffic_rows_captured']} captured rows, "
             f"{record['heldout_rows']} held out)",
             f"- traffic rows used: {record['traffic_rows']} (share {record['traffic_share']:g})",
             "- training rows: " + ", ".join(f"{n} {c}" for n, c in record["rows"].items()),
             f"- algorithm: {meta.get('algorithm')}, {meta.get('training', {}).get('step')} steps", "",
             "## Held-out tau", "",
             f"Tau is the {record['tau_kind']}; each domain's held-out rows are the same for both drafters.", "",
             "| domain | before | after |", "|---|---|---|"]
    guarded = set(record.get("guarded", ()))
    lines += [f"| {n}{' (guarded: not a training set)' if n in guarded else ''} | {t['before']:.3f} | "
              f"{t['after']:.3f} |" for n, t in record["tau"].items()]
    return "\n".join(lines) + "\n"

