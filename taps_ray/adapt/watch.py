"""``taps adapt --watch``: capture -> adapt -> gated promotion, continuously, beside a running ``taps serve``.

The loop joins the serving cluster (``RAY_ADDRESS``, as a Ray job does) and follows one drafter
(``adapt.drafter``) of the application ``serve.app_name`` and its capture folder (``serve.capture``).
Every ``adapt.poll_s`` it reads how many requests the folder has captured
(:func:`~taps_ray.data.capture.captured_requests`; a verifier replica writes its rows
``serve.capture.rows_per_shard`` at a time) and moves drafter replicas that Serve started since the last
promotion to the promoted version (:meth:`~taps_ray.adapt.promote.ServedDrafter.reconcile`). Once
``adapt.every`` requests have been captured since the last round, and the folder keeps more rows than
``train.heldout_rows``, a round runs:

1. the capture folder is frozen into ``<run folder>/adapt/traffic-<captured>``
   (:func:`~taps_ray.data.capture.snapshot`: hard links, so no copy of the features), and
   :func:`~taps_ray.adapt.finetune.run_adapt` fine-tunes the version now serving on that traffic mixed
   with its original datasets (a Ray Train run that asks for ``train.num_workers`` workers and nothing
   more, so serving keeps its replicas) and scores before / after on the same held-out rows;
2. :func:`~taps_ray.adapt.promote.decide` gates it (``adapt.margin``, ``adapt.min_gain``);
3. a version that passes is promoted through the hot-swap path (running requests keep their drafter),
   one that does not stays in its folder; one that reached only some replicas is rolled back on all of
   them (:class:`~taps_ray.adapt.promote.PartialSwap`) and kept aside, logged and recorded ``partial``;
4. the decision goes to the promotion log (``<run folder>/adapt/promotions.jsonl``, with the captured count
   it was taken at) and to the version folder's ``promotion.json``;
5. what the loop no longer needs is deleted (:meth:`Watch.prune`): the drafter's versions but the last
   ``adapt.keep`` promoted ones (the one serving and those before it, to roll back to) and the newest, and
   every traffic snapshot but this round's (a snapshot's hard links would keep captured rows the capture
   folder's budget or ``max_age_s`` has evicted).

A round whose training fails is logged and skipped until ``adapt.every`` more requests arrive; the loop
goes on. Restarted, the loop resumes from its log: the last promoted version is served again and the
request count restarts from the last round's.

A round holds the run folder's lock (:func:`~taps_ray.runstate.folder_lock`, as ``taps train`` does): while
another process holds it (a ``taps train`` into the same run folder), the due round waits, logged once with
the holder, and runs on the first poll after it is released. For its whole run the loop also holds
``<run folder>/adapt/.watch-<drafter>.lock``: a second loop on the same drafter and run folder is refused.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from taps_ray.adapt.finetune import VERSION_PREFIX, AdaptError, run_adapt
from taps_ray.adapt.promote import (
    Decision,
    PartialSwap,
    Promotion,
    PromotionError,
    PromotionLog,
    decide,
    record,
)
from taps_ray.config import ExperimentConfig
from taps_ray.data.capture import capture_dir, captured_requests, snapshot
from taps_ray.runstate import FolderLocked, folder_lock, write_json
from taps_ray.train.variant import TrainLaunchError

log = logging.getLogger(__name__)

PROMOTION_FILE = "promotion.json"
PRUNED = ".pruned"


class PromotionTarget(Protocol):
    """What the loop promotes into: :class:`~taps_ray.adapt.promote.ServedDrafter`, or an in-process
    stand-in in tests."""

    promoted: str | None

    def serving(self) -> str | None: ...

    def swap(self, checkpoint: str) -> object: ...

    def reconcile(self) -> int: ...


def watched_drafter(cfg: ExperimentConfig, name: str | None = None) -> str:
    """``name``, else ``adapt.drafter``, else the first drafter of ``serve.drafters`` that is no weight average."""
    name = name or cfg.adapt.drafter
    if name is not None:
        return name
    plain = [n for n, d in cfg.serve.drafters.items() if not d.average_of]
    if not plain:
        raise PromotionError("serve.drafters has no drafter to adapt (each is a weight average)")
    return plain[0]


def traffic_folder(cfg: ExperimentConfig, traffic: str | Path | None = None) -> Path:
    """``traffic``, else the application's capture folder (``serve.capture.dir``)."""
    return Path(traffic) if traffic else capture_dir(cfg.serve.capture, cfg.serve.app_name)


class Watch:
    """The loop of the module docstring over ``served`` (drafter ``name``) and the capture folder ``traffic``."""

    def __init__(self, cfg: ExperimentConfig, name: str, served: PromotionTarget, traffic: Path, target=None):
        self.cfg, self.name, self.served, self.traffic = cfg, name, served, Path(traffic)
        self.target = target
        self.log = PromotionLog(cfg.run_dir)
        self.waiting = False
        mine = [e for e in self.log.entries() if e["drafter"] == name]
        self.baseline = max((e.get("captured", 0) for e in mine), default=0)
        promoted = self.log.last_promoted(name)
        if promoted is not None:
            log.info("adapt watch: %s was last promoted to %s; serving it again", name, promoted)
            self.served.promoted = promoted

    def due(self) -> int | None:
        """The captured count when a round is due now, else None."""
        captured, kept = captured_requests(self.traffic)
        if captured - self.baseline < self.cfg.adapt.every:
            return None
        if kept <= self.cfg.train.heldout_rows:
            log.info("adapt watch: %d captured rows kept, more than train.heldout_rows=%d needed", kept,
                     self.cfg.train.heldout_rows)
            return None
        return captured

    def round(self, captured: int) -> Promotion | None:
        """Adapt the serving version, gate, promote or keep aside, log, prune; None when training failed.
        Holds the run folder's lock; :class:`~taps_ray.runstate.FolderLocked` naming the holder when another
        process holds it (or a lock training needs), with the round not taken."""
        with folder_lock(self.cfg.run_dir, f"taps adapt --watch (drafter {self.name})"):
            return self._round(captured)

    def _round(self, captured: int) -> Promotion | None:
        source = self.served.promoted or self.served.serving()
        if source is None:
            raise PromotionError(f"drafter {self.name!r} serves a freshly initialised drafter; give it a checkpoint "
                                 f"(serve.drafters.{self.name}.checkpoint) to adapt from")
        frozen = snapshot(self.traffic, self.log.path.parent / f"traffic-{captured}")
        captured = captured_requests(frozen)[0]
        try:
            result = run_adapt(self.cfg, frozen, source, target=self.target)
        except (AdaptError, TrainLaunchError) as err:
            self.baseline = captured
            log.error("adapt watch: round at %d captured requests failed: %s", captured, err)
            self.prune(frozen, source)
            return None
        self.baseline = captured
        decision: Decision = decide(result.record["tau"], self.cfg.adapt.margin, self.cfg.adapt.min_gain)
        partial = False
        if decision.promote:
            try:
                self.served.swap(str(result.out))
            except PromotionError as err:
                partial = isinstance(err, PartialSwap)
                decision = Decision(False, f"passed the gate ({decision.reason}) but the swap failed: {err}",
                                    decision.gain, decision.losses)
        entry = record(self.name, result.version, result.out, source, decision, result.record, captured, partial)
        write_json(Path(result.out) / PROMOTION_FILE, asdict(entry))
        self.log.append(entry)
        (log.warning if partial else log.info)(
            "adapt watch: version %d %s: %s", result.version,
            "promoted" if decision.promote else "kept aside after a partial swap" if partial else "kept aside",
            decision.reason)
        self.prune(frozen, source)
        return entry

    def prune(self, frozen: Path, source: str | None = None) -> list[Path]:
        """Delete what the loop no longer needs; the paths deleted.

        Candidates are the ``adapt-vN`` folders of the run folder that the promotion log names for this
        drafter, and every ``traffic-*`` snapshot of ``<run folder>/adapt`` but ``frozen``. Kept: the drafter's
        last ``adapt.keep`` promoted versions, its newest version, the version it serves (``promoted``) or
        was adapted from (``source``), and every checkpoint ``serve.drafters`` names. Each folder is renamed
        to a hidden ``.NAME.pruned`` first, then removed, so a crash never leaves half a folder under a
        version's name; the next prune removes what a crash left. A folder that cannot be removed is logged
        and left."""
        drafters = (self.cfg.run_dir / "drafters").resolve()
        mine = [e for e in self.log.entries() if e["drafter"] == self.name]
        promoted = [e["checkpoint"] for e in mine if e["promoted"]]
        configured = [d.checkpoint for d in self.cfg.serve.drafters.values()]
        wanted = {*promoted[-self.cfg.adapt.keep:], *(e["checkpoint"] for e in mine[-1:]),
                  self.served.promoted, source, *configured}
        keep = {Path(p).expanduser().resolve() for p in wanted if p}
        versions = [p for e in mine if (p := Path(e["checkpoint"]).expanduser().resolve()).parent == drafters
                    and re.fullmatch(rf"{VERSION_PREFIX}\d+", p.name) and p not in keep and p.is_dir()]
        adapt = self.log.path.parent
        snapshots = [p for p in sorted(adapt.glob("traffic-*")) if p.is_dir() and p.resolve() != frozen.resolve()]
        removed = [p for p in dict.fromkeys([*versions, *snapshots]) if _remove(p)]
        for leftover in [*drafters.glob(f".*{PRUNED}"), *adapt.glob(f".*{PRUNED}")]:
            shutil.rmtree(leftover, ignore_errors=True)
        if removed:
            log.info("adapt watch: pruned %s (adapt.keep=%d)", ", ".join(p.name for p in removed),
                     self.cfg.adapt.keep)
        return removed

    def run(self, stop: threading.Event | None = None) -> list[Promotion]:
        """Poll until ``adapt.rounds`` rounds have run (None: until ``stop`` is set or Ctrl-C); a round that
        waits for the run folder's lock is not counted. :class:`~taps_ray.runstate.FolderLocked` when
        another loop watches this drafter into this run folder."""
        with folder_lock(self.log.path.parent, f"taps adapt --watch (drafter {self.name})",
                         name=f".watch-{self.name}.lock"):
            return self._run(stop or threading.Event())

    def _run(self, stop: threading.Event) -> list[Promotion]:
        done: list[Promotion] = []
        rounds = 0
        while not stop.is_set() and (self.cfg.adapt.rounds is None or rounds < self.cfg.adapt.rounds):
            self.served.reconcile()
            captured = self.due()
            if captured is None:
                stop.wait(self.cfg.adapt.poll_s)
                continue
            try:
                entry = self.round(captured)
            except FolderLocked as err:
                if not self.waiting:
                    log.warning("adapt watch: the round at %d captured requests waits for the run folder, looking "
                                "again every adapt.poll_s=%gs: %s", captured, self.cfg.adapt.poll_s, err)
                self.waiting = True
                stop.wait(self.cfg.adapt.poll_s)
                continue
            if self.waiting:
                log.info("adapt watch: the run folder is free again")
            self.waiting = False
            rounds += 1
            if entry is not None:
                done.append(entry)
        return done


def _remove(path: Path) -> bool:
    """Rename ``path`` to ``.NAME.pruned`` beside it, then delete it; False (logged) when that fails."""
    trash = path.with_name(f".{path.name}{PRUNED}")
    try:
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
        shutil.rmtree(trash)
    except OSError as err:
        log.warning("adapt watch: could not delete %s: %s", path, err)
        return False
    return True


def watch(cfg: ExperimentConfig, traffic: str | Path | None = None, drafter: str | None = None,
          stop: threading.Event | None = None) -> list[Promotion]:
    """``taps adapt --watch``: :class:`Watch` over drafter ``drafter`` of the running application."""
    from taps_ray.adapt.promote import ServedDrafter
    from taps_ray.runtime.cluster import init_ray

    name = watched_drafter(cfg, drafter)
    init_ray()
    served = ServedDrafter(cfg, name)
    folder = traffic_folder(cfg, traffic)
    log.info("adapt watch: drafter %s of %s, capture folder %s, a round every %d captured requests", name,
             cfg.serve.app_name, folder, cfg.adapt.every)
    return Watch(cfg, name, served, folder).run(stop)
