"""Gated promotion of an adapted drafter version into a running ``taps serve`` application.

:func:`decide` is the gate, from the ``tau`` record ``taps adapt`` writes (held-out tau before / after per
domain): a version is promoted only if its tau on the traffic beats the serving version's by more than
``min_gain`` and it loses no more than ``margin`` on any other domain of the record (the drafter's own
datasets and every other prepared dataset, :func:`~taps_ray.adapt.finetune.gate_domains`); otherwise it is kept aside (its
folder stays, with the reason in the promotion log).

:class:`ServedDrafter` is one drafter deployment of a running application, through Serve's public handle
API: :meth:`~ServedDrafter.swap` calls the replicas' ``reconfigure`` with the deployment's ``user_config``
but the new checkpoint (the hot-swap path: a running request keeps the drafter it started with, a new one
drafts with the new version) and returns once every replica reports it. A swap that only some replicas
took (one raised loading it, or still serves another version after a second try) is rolled back: every
replica is moved back to the version served before, which stays the promoted one, and
:class:`PartialSwap` names the replicas on each side. A replica Serve starts later
(a replacement, autoscaling) starts from the deployment's own ``user_config``, the configured checkpoint:
:meth:`~ServedDrafter.reconcile` moves such replicas to the promoted version, and the ``taps adapt
--watch`` loop calls it on every poll. Until then that replica drafts with the older version: outputs are
unchanged (verification is exact whatever drafts), only its speed differs.

:class:`PromotionLog` appends one JSON line per decision to ``<run folder>/adapt/promotions.jsonl``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from taps_ray.config import ExperimentConfig
from taps_ray.data.capture import TRAFFIC
from taps_ray.runstate import append_jsonl, read_jsonl

log = logging.getLogger(__name__)

LOG_NAME = "promotions.jsonl"


class PromotionError(RuntimeError):
    """A drafter that cannot be promoted into, or a swap the replicas did not take."""


class PartialSwap(PromotionError):
    """A swap that reached only some replicas and was rolled back (the message names them)."""


@dataclass(frozen=True)
class Decision:
    """The gate's verdict: ``promote``, why, the traffic tau ``gain`` (after - before) and the tau
    ``losses`` per other domain (before - after; negative: a gain)."""

    promote: bool
    reason: str
    gain: float
    losses: dict[str, float]


def decide(tau: dict[str, dict[str, float]], margin: float, min_gain: float = 0.0) -> Decision:
    """The gate on ``tau`` (domain -> ``{"before", "after"}``, with a ``traffic`` domain): promote when
    the traffic gain exceeds ``min_gain`` and no other domain loses more than ``margin``."""
    if TRAFFIC not in tau:
        raise ValueError(f"the tau record has no {TRAFFIC!r} domain (domains: {sorted(tau)})")
    gain = round(tau[TRAFFIC]["after"] - tau[TRAFFIC]["before"], 4)
    losses = {n: round(t["before"] - t["after"], 4) for n, t in tau.items() if n != TRAFFIC}
    if gain <= min_gain:
        return Decision(False, f"traffic tau gain {gain:+.3f} is not above {min_gain:+.3f}", gain, losses)
    over = {n: loss for n, loss in losses.items() if loss > margin}
    if over:
        worst = max(over, key=over.get)
        return Decision(False, f"tau on {worst} drops by {over[worst]:.3f}, more than the margin {margin:.3f}",
                        gain, losses)
    worst = max(losses.values(), default=0.0)
    return Decision(True, f"traffic tau gain {gain:+.3f}; largest loss on another domain {worst:.3f} "
                          f"<= margin {margin:.3f}", gain, losses)


class ServedDrafter:
    """Drafter ``name`` of the running application ``cfg.serve.app_name`` (needs a connected Ray)."""

    def __init__(self, cfg: ExperimentConfig, name: str, timeout_s: float = 120.0):
        from taps_ray.serving.app import drafter_user_config

        drafters = cfg.serve.drafters
        if name not in drafters:
            raise PromotionError(f"serve.drafters has no drafter {name!r}; drafters: {sorted(drafters)}")
        if drafters[name].average_of:
            raise PromotionError(f"drafter {name!r} is the weight average of {drafters[name].average_of}; "
                                 f"promote into one of them instead")
        self.name, self.app, self.timeout_s = name, cfg.serve.app_name, timeout_s
        self.user_config = drafter_user_config(cfg, name)
        self.promoted: str | None = None

    def _handle(self):
        from ray import serve

        from taps_ray.serving.plan import drafter_deployment_name

        try:
            return serve.get_deployment_handle(drafter_deployment_name(self.name), self.app)
        except Exception as err:
            raise PromotionError(f"no running drafter {self.name!r} in Serve application {self.app!r} "
                                 f"(is `taps serve` running on this cluster?): {err}") from None

    def replicas(self) -> list[dict]:
        """Each replica's ``stats`` (``spec`` the weights it serves, ``version``)."""
        return self._handle().broadcast("stats").results(timeout_s=self.timeout_s)

    def serving(self) -> str | None:
        """The checkpoint most replicas serve (None: a fresh drafter)."""
        specs = Counter(r["spec"].get("checkpoint") for r in self.replicas())
        return specs.most_common(1)[0][0] if specs else self.user_config.get("checkpoint")

    def _apply(self, checkpoint: str | None) -> tuple[list[dict], list[str]]:
        """Reconfigure every replica to ``checkpoint``; their stats after, and the errors replicas raised."""
        config = {**self.user_config, "checkpoint": checkpoint}
        try:
            outcomes = self._handle().broadcast("reconfigure", config).results(timeout_s=self.timeout_s,
                                                                               return_exceptions=True)
        except Exception as err:  # a broadcast that failed as a whole: the stats say who took it
            outcomes = [err]
        errors = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
        return self.replicas(), errors

    def swap(self, checkpoint: str) -> list[dict]:
        """Every replica serves ``checkpoint`` from its next request on; their stats after the swap.

        Replicas that do not report it while none raised (started during the swap) are asked once more.
        :class:`PromotionError` when no replica took it; :class:`PartialSwap` when only some did, after
        moving them back to the version served before (the promoted one, else the configured one, which
        becomes ``promoted`` so that :meth:`reconcile` keeps every replica on it)."""
        checkpoint = str(checkpoint)
        previous = self.promoted or self.user_config.get("checkpoint")
        stats, errors = self._apply(checkpoint)
        if not errors and _off(stats, checkpoint):
            stats, errors = self._apply(checkpoint)
        stale = _off(stats, checkpoint)
        if not stale:
            self.promoted = checkpoint
            log.info("drafter %s: promoted %s on %d replica(s)", self.name, checkpoint, len(stats))
            return stats
        why = "; ".join(errors) or "they still serve another version"
        took = [name for r in stats if (name := str(r.get("replica"))) not in stale]
        if not took:
            raise PromotionError(f"drafter {self.name!r}: no replica took {checkpoint} ({why}); each keeps the "
                                 f"version it served")
        log.warning("drafter %s: the swap to %s reached replica(s) %s only, not %s (%s); moving them back to %s",
                    self.name, checkpoint, took, stale, why, previous)
        self.promoted = previous
        back, _ = self._apply(previous)
        left = _off(back, previous)
        after = (f"every replica serves {previous} again" if not left else
                 f"replica(s) {left} do not serve {previous} yet: reconcile moves them on each poll")
        if left:
            log.error("drafter %s: after a partial swap %s", self.name, after)
        raise PartialSwap(f"drafter {self.name!r}: partial swap, rolled back: replica(s) {took} took {checkpoint}, "
                          f"{stale} did not ({why}); {after}")

    def reconcile(self) -> int:
        """Move replicas that do not serve the promoted checkpoint to it (replicas Serve started since
        the swap begin from the configured one); how many were off it. Replicas still off it afterwards
        are logged and tried again on the next call."""
        if self.promoted is None:
            return 0
        stale = _off(self.replicas(), self.promoted)
        if stale:
            log.info("drafter %s: replica(s) %s not on the promoted %s; moving them", self.name, stale, self.promoted)
            stats, errors = self._apply(self.promoted)
            if left := _off(stats, self.promoted):
                log.warning("drafter %s: replica(s) %s still not on %s (%s); trying again on the next poll",
                            self.name, left, self.promoted, "; ".join(errors) or "no error")
        return len(stale)


def _off(stats: list[dict], checkpoint: str | None) -> list[str]:
    """The replicas of ``stats`` that do not serve ``checkpoint``."""
    return [str(r.get("replica")) for r in stats if r["spec"].get("checkpoint") != checkpoint]


@dataclass
class Promotion:
    """One line of the promotion log: the version, its parent (the version serving when it was trained), the
    gate's decision and the tau it was taken on, the requests captured by then, and ``partial``: the
    version passed the gate but reached only some replicas and was rolled back (:class:`PartialSwap`)."""

    at: float
    drafter: str
    version: int
    checkpoint: str
    parent: str | None
    promoted: bool
    reason: str
    gain: float
    losses: dict[str, float]
    tau: dict[str, dict[str, float]]
    traffic_rows: int
    captured: int
    partial: bool = False


class PromotionLog:
    """``<run folder>/adapt/promotions.jsonl``: every decision, promoted or kept aside."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "adapt" / LOG_NAME

    def append(self, entry: Promotion) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.path, [asdict(entry)])

    def entries(self) -> list[dict]:
        return read_jsonl(self.path)

    def last_promoted(self, drafter: str) -> str | None:
        """The checkpoint last promoted into ``drafter`` (None: none yet)."""
        done = [e for e in self.entries() if e["drafter"] == drafter and e["promoted"]]
        return done[-1]["checkpoint"] if done else None


def record(drafter: str, version: int, checkpoint: str | Path, parent: str | None, decision: Decision,
           adapt_record: dict, captured: int, partial: bool = False) -> Promotion:
    """The log line of ``decision`` on the version ``taps adapt`` wrote (its ``adapt`` record), taken when
    the capture folder had captured ``captured`` requests."""
    return Promotion(at=time.time(), drafter=drafter, version=version, checkpoint=str(checkpoint), parent=parent,
                     promoted=decision.promote, reason=decision.reason, gain=decision.gain, losses=decision.losses,
                     tau=adapt_record["tau"], traffic_rows=int(adapt_record["traffic_rows"]), captured=captured,
                     partial=partial)
