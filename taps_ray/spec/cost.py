"""A measured cost model of verification, and the tree size that maximises tokens per second, per step.

:class:`CostModel`: for one machine and engine setting, the seconds of a verification forward of n tree nodes
(n = 1: a plain step) on a log grid, measured by :func:`measure` and cached under ``TAPS_CACHE/cost/`` keyed by
:func:`~taps_ray.spec.machine.fingerprint` (CPU model and flags or GPU name, dtype, threads, torch version,
engine, the target's sizes).

:class:`TreeBudget` uses it each step. With ``p_i`` the predicted acceptance chance of node i (the rate observed
for nodes of its kind and score bin, ``score`` the path's cumulative draft log-prob that EAGLE-2 ranks by;
``exp(score)`` before anything is observed), the best n nodes append ``E(n) = 1 + sum_{i < n} p_i`` tokens for
``draft_s + verify(n)`` seconds; the budget keeps the n maximising ``E(n) / (draft_s + verify(n))``, n = 1
included, and skips drafting while it would not beat a plain step (probing again every ``probe_every`` steps,
the interval doubling up to ``8 * probe_every`` while it still does not pay, and never so often that the probes'
observed loss exceeds :data:`PROBE_SHARE` of the time). The model gives the curve's shape;
its level follows the run (:attr:`TreeBudget.scale`: observed over predicted seconds). A cached model that runs
far faster than it predicts was measured on a busy machine and is retired (:func:`retire_cost_model`). The
choice changes which tokens are proposed, never which are accepted.

In a batch (:mod:`taps_ray.spec.batch`) the forward's time is shared and waits for every request's drafting
(:class:`~taps_ray.spec.batch_load.BatchLoad`). The ``N - 1`` requests sharing this budget (its peers) decide
alike; the rest, ``R`` rows expected to append ``S`` tokens after ``D`` seconds of drafting, as they did. A
request keeps the n maximising ``(N E(n) + S) / (D + N draft_s + verify(R + N n))`` (N = 1, R = S = D = 0 alone).

Depth is chosen the same way before drafting (:meth:`TreeBudget.depth`): each drafted step tells in hindsight
what a shallower tree would have appended and verified (an accepted path keeps its nodes down to that depth and
those on the prompt-lookup chain), and each depth's drafting seconds are timed; the budget drafts to the depth
with the most tokens per second (the configured depth every ``explore_every``-th drafted step).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from taps_ray.spec.batch_load import Others
from taps_ray.spec.calibrate import (
    calibrate_int4_rows,
    chain_trees,
    retire_int4_rows,
    store_json,
    time_verify,
)
from taps_ray.spec.machine import fingerprint
from taps_ray.spec.tree import DraftTree

log = logging.getLogger(__name__)

GRID = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class CostModel:
    """``verify_s[i]``: seconds of one verification forward (logits included) of ``nodes[i]`` nodes after
    ``prefix`` cached tokens; ``key``: the :func:`fingerprint` it was measured under."""

    nodes: list[int]
    verify_s: list[float]
    prefix: int
    key: dict = field(default_factory=dict)
    measured_s: float = 0.0

    def verify(self, nodes: float | torch.Tensor) -> torch.Tensor:
        """Seconds of verifying ``nodes`` nodes (tensor of any shape), linear between grid points and beyond."""
        n = torch.as_tensor(nodes, dtype=torch.float64)
        xs = torch.tensor(self.nodes, dtype=torch.float64)
        ys = torch.tensor(self.verify_s, dtype=torch.float64)
        upper = torch.searchsorted(xs, n.clamp(min=xs[0])).clamp(1, len(xs) - 1)
        x0, x1, y0, y1 = xs[upper - 1], xs[upper], ys[upper - 1], ys[upper]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def verify_one(self, nodes: float) -> float:
        """:meth:`verify` of one node count, in plain Python (the same float64 arithmetic, a few microseconds:
        a budget asks it for every request at every step)."""
        xs, ys = self.nodes, self.verify_s
        n = float(nodes)
        upper = min(max(bisect.bisect_left(xs, max(n, xs[0])), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[upper - 1], xs[upper], ys[upper - 1], ys[upper]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    @property
    def plain_s(self) -> float:
        return self.verify_one(1)

    def relative(self) -> dict[int, float]:
        """Verification cost of each grid size relative to a plain step."""
        return {n: round(s / self.verify_s[0], 3) for n, s in zip(self.nodes, self.verify_s)}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(**data)

    def describe(self) -> str:
        """:meth:`summary` with what it was measured on (hardware, dtype, threads, engine)."""
        k = self.key
        return (f"{self.summary()} ({k.get('hardware')}, {k.get('dtype')}, {k.get('threads')} threads, "
                f"engine {k.get('engine')})")

    def summary(self) -> str:
        """One line: a plain step's milliseconds and each size's cost relative to it."""
        rel = ", ".join(f"{n}: {r:.2f}" for n, r in self.relative().items())
        return f"plain step {1e3 * self.plain_s:.1f} ms; verification cost relative to it by nodes {{{rel}}}"


@torch.inference_mode()
def measure(target, nodes=GRID, prefix: int = 192, repeats: int = 5) -> CostModel:
    """Time one verification forward of each size in ``nodes`` (a chain tree, logits included) after a
    ``prefix``-token cache: after one warm-up round, ``repeats`` rounds over every size (so that a neighbour's
    burst slows every size alike rather than one), the fastest of each size, made non-decreasing in n."""
    start = time.perf_counter()
    cache, trees, prefix = chain_trees(target, nodes, prefix)
    times: list[list[float]] = [[] for _ in nodes]
    for _ in range(repeats + 1):
        for tree, seen in zip(trees, times):
            seen.append(time_verify(target, tree, cache, prefix))
    fastest = torch.tensor([min(seen[1:]) for seen in times], dtype=torch.float64).cummax(0).values
    return CostModel(list(nodes), fastest.tolist(), prefix, fingerprint(target), round(time.perf_counter() - start, 2))


def cache_dir() -> Path:
    from taps_ray import artifacts

    return artifacts.cache_dir() / "cost"


def cost_path(key: dict) -> Path:
    """Where the cost model of fingerprint ``key`` is cached."""
    return cache_dir() / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"


_MEASURING = threading.Lock()


def cost_model(target, refresh: bool = False) -> CostModel:
    """The cached :class:`CostModel` of ``target`` on this machine (measured and stored when missing, stale
    or ``refresh``; an int4 engine's step threshold calibrated first, :mod:`taps_ray.spec.calibrate`); kept on
    the target object for the process. Thread-safe: requests starting together
    wait for one measurement."""
    with _MEASURING:
        return _cost_model(target, refresh)


def _cost_model(target, refresh: bool) -> CostModel:
    calibrate_int4_rows(target, refresh)
    key = fingerprint(target)
    held = getattr(target, "_cost_model", None)
    if held is not None and held.key == key and not refresh:
        return held
    path = cost_path(key)
    model = None
    if path.is_file() and not refresh:
        try:
            model = CostModel.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError):
            model = None
        if model is not None and model.key != key:
            model = None
    if model is None:
        model = measure(target)
        store_json(path, model.to_dict())
    target.__dict__["_cost_model"] = model
    return model


STALE_SCALE, STALE_AFTER = 0.5, 32
"""A cached model running under STALE_SCALE of its prediction after STALE_AFTER timed steps is retired."""


def retire_cost_model(model: CostModel) -> bool:
    """Remove ``model`` from the cache if the file still holds it, with the int4 threshold it ran with (the next
    process measures both again); True if removed."""
    path = cost_path(model.key)
    try:
        if CostModel.from_dict(json.loads(path.read_text())).verify_s == model.verify_s:
            path.unlink()
            retire_int4_rows(model.key)
            return True
    except (OSError, ValueError, TypeError):
        pass
    return False


PROBE_SHARE = 0.02
"""Probes of drafting that does not pay may cost at most this share of the decoding time between them."""

SCORE_EDGES = (-0.25, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Bins of a node's path score (cumulative draft log-prob): (-0.25, 0], (-0.5, -0.25], .., below -6."""


@dataclass
class _DepthStats:
    """Running means, for trees drafted down to one depth: ``gain`` tokens appended, ``nodes`` verified (both
    from every step drafted at least that deep, in hindsight), ``draft_s`` seconds of drafting (from the steps
    drafted exactly that deep); ``seen`` / ``timed``: how many steps fed them."""

    gain: float = 0.0
    nodes: float = 0.0
    draft_s: float = 0.0
    seen: int = 0
    timed: int = 0


class TreeBudget:
    """Per-step tree sizes for one drafting strategy (see the module docstring); share one across that
    strategy's requests so that its calibration carries over. ``cost`` (None: the target's cached
    :func:`cost_model`, taken by :meth:`bind` when a decode starts); ``decay``: weight of the past per observed
    step; ``probe_every``: how often a step drafts once drafting stops paying (the interval doubles after each
    probe that still does not pay, up to ``8 * probe_every``, and never so often that the probes' observed loss
    exceeds ``probe_share`` of the time, :data:`PROBE_SHARE` by default); ``explore_every``: how often a drafted step
    verifies more nodes than pay (twice as many, at least 4, at most the tree), so that the score bins next in
    line keep being observed; ``chosen``: the node counts of the last 4096 decisions.

    A node's chance of acceptance is the acceptance rate observed for nodes of its kind (drafted, or
    prompt-lookup: the last ``tree.meta["lookup_nodes"]`` of a tree) in its score bin
    (:data:`SCORE_EDGES`), starting from ``exp(score)`` with the weight of ``prior`` observations, and
    capped by its ancestors' (a node is accepted only with its whole path).
    """

    KINDS = ("draft", "lookup")
    DEPTH_EVIDENCE = 4

    def __init__(self, cost: CostModel | None = None, decay: float = 0.98, probe_every: int = 8,
                 explore_every: int = 4, prior: float = 2.0, probe_share: float = PROBE_SHARE):
        self.cost, self.decay, self.probe_every, self.explore_every = cost, decay, probe_every, explore_every
        self.probe_share = probe_share
        self._edges = torch.tensor(SCORE_EDGES, dtype=torch.float64)
        mids = torch.tensor([0.0, *SCORE_EDGES], dtype=torch.float64)
        mids = torch.cat([(mids[:-1] + mids[1:]) / 2, mids[-1:] - 1.0])
        self._prior_rate, self._prior = mids.exp(), prior
        bins = len(SCORE_EDGES) + 1
        self._seen = {kind: torch.zeros(bins, dtype=torch.float64) for kind in self.KINDS}
        self._hits = {kind: torch.zeros(bins, dtype=torch.float64) for kind in self.KINDS}
        self._drafted_steps = 0
        self._depths: dict[int, _DepthStats] = {}
        self._drafted_depth: int | None = None
        self._skipped = 0
        self._probe_gap = probe_every
        self._new_request = False
        self._drafted = 0
        self._scaled = 0
        self._judged = False  # whether the cost model was checked against the run (once; see STALE_SCALE)
        self.scale = 1.0
        self.chosen: deque[int] = deque(maxlen=4096)

    def bind(self, target) -> TreeBudget:
        """Start a request on ``target``: take its cost model on this machine when none was given (measured at
        first use); a request alone probes again after ``probe_every`` skipped steps (acceptance follows the
        context, so a new request's drafting may pay where the last one's did not). Beside peers the probes keep
        backing off: the peers' count, seen every step, already tells when the load lets drafting pay."""
        if self.cost is None:
            self.cost = cost_model(target)
        self._new_request = True
        return self

    def _cost(self) -> CostModel:
        if self.cost is None:
            raise RuntimeError("this TreeBudget has no cost model yet: give it one or bind(target) it first")
        return self.cost

    def fresh(self) -> TreeBudget:
        """A new budget with this one's settings and cost model (still judged if it was) and nothing observed."""
        budget = TreeBudget(self.cost, self.decay, self.probe_every, self.explore_every, self._prior, self.probe_share)
        budget._judged = self._judged
        return budget

    def rates(self, kind: str = "draft") -> torch.Tensor:
        """[bins] the acceptance rate of ``kind`` nodes per score bin (observed, with the prior)."""
        return ((self._hits[kind] + self._prior * self._prior_rate) / (self._seen[kind] + self._prior)).clamp(max=1.0)

    def _bin(self, score: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(-score.double().cpu(), -self._edges, right=False)

    def should_draft(self, others: tuple = Others()) -> bool:
        """Whether this step drafts: yes unless, at the recent drafted steps' tokens, drafting seconds and
        verified nodes, drafted steps would append fewer tokens per second than plain ones beside the batch's
        :class:`Others` (``(N g + S) / (D + N d + verify(R + N n))`` against ``(N + S) / (D + verify(R + N))``,
        N = 1 + peers); then once in a while, to see again: after ``probe_every`` skipped steps (``probe_every *
        N`` calls of the budget its peers share), the gap doubling after each probe that still does not pay, and
        at least the gap that keeps the probes' loss within ``probe_share`` of the time (:meth:`_probe_floor`)."""
        others = Others(*others)
        if self._new_request:
            self._new_request = False
            if not others.peers:
                self._probe_gap, self._skipped = self.probe_every, 0
        if not self._drafted_steps:
            return True
        rates, plain_s = self._depth_rates(others), self._plain_s(others)
        if self._pays(others, rates, plain_s):
            self._probe_gap, self._skipped = self.probe_every, 0
            return True
        self._skipped += 1
        if self._skipped >= max(self._probe_gap, self._probe_floor(others, rates, plain_s)) * (1 + others.peers):
            self._skipped = 0
            self._probe_gap = min(2 * self._probe_gap, 8 * self.probe_every)
            return True
        return False

    def pays(self, others: tuple = Others()) -> bool:
        """Whether drafting, as recently observed at its best depth, beats a plain step beside ``others`` (see
        :meth:`should_draft`)."""
        others = Others(*others)
        return self._pays(others, self._depth_rates(others), self._plain_s(others))

    def _plain_s(self, others: Others) -> float:
        """Seconds of a plain step beside ``others``: their drafting, then one forward of their rows and N."""
        return others.draft_s + self.scale * self._cost().verify_one(others.rows + 1 + others.peers)

    @staticmethod
    def _pays(others: Others, rates: dict[int, float], plain_s: float) -> bool:
        return not rates or max(rates.values()) >= (1 + others.peers + others.tokens) / plain_s

    def _probe_floor(self, others: Others, rates: dict[int, float], plain_s: float) -> float:
        """Skipped steps before a probe so that probing costs at most ``probe_share`` of the plain steps' time: a
        probe at the depth paying best (``rates``: :meth:`_depth_rates`) loses its seconds less the time plain
        steps (``plain_s`` each) would take for its tokens."""
        if not rates:
            return 0.0
        best = max(rates, key=lambda d: rates[d])
        appended = (1 + others.peers) * self._depths[best].gain + others.tokens
        lost = appended * (1 / rates[best] - plain_s / (1 + others.peers + others.tokens))
        return max(lost, 0.0) / (self.probe_share * plain_s)

    def _draft_s(self, depth: int) -> float:
        """Seconds of drafting down to ``depth``: as timed there, else scaled from the deepest timed depth by
        the drafter passes (one per level and one for the queued pairs); 0 before anything is timed."""
        stats = self._depths[depth]
        if stats.timed:
            return stats.draft_s
        timed = [d for d, s in self._depths.items() if s.timed]
        if not timed:
            return 0.0
        deepest = max(timed)
        return self._depths[deepest].draft_s * (depth + 1) / (deepest + 1)

    def _depth_rates(self, others: tuple = Others()) -> dict[int, float]:
        """Expected tokens per second of a drafted step beside ``others``, per depth observed."""
        rows, tokens, waits, peers = Others(*others)
        n = 1 + peers
        return {d: (n * s.gain + tokens) / (waits + n * self._draft_s(d)
                                             + self.scale * self._cost().verify_one(rows + n * s.nodes))
                for d, s in self._depths.items() if s.seen}

    def depth(self, others: tuple = Others()) -> int | None:
        """The depth to draft this step down to (node depth: 1 = the root's children only), the one whose
        observed tokens per second beside ``others`` are highest; None (the strategy's own depth) until
        ``DEPTH_EVIDENCE`` drafted steps were observed at every depth, when the deepest pays best, and every
        ``explore_every``-th drafted step."""
        if not self._depths or self._depths[max(self._depths)].seen < self.DEPTH_EVIDENCE:
            return None
        if self.explore_every and (self._drafted + 1) % self.explore_every == 0:
            return None
        rates = self._depth_rates(others)
        best = max(rates, key=lambda d: rates[d])
        return None if best == max(self._depths) else best

    @staticmethod
    def _is_lookup(tree: DraftTree) -> torch.Tensor:
        """[N] bool: the tree's prompt-lookup nodes."""
        flags = torch.zeros(tree.size, dtype=torch.bool)
        m = int(tree.meta.get("lookup_nodes", 0) or 0)
        if m:
            flags[tree.size - m:] = True
        return flags

    def _deepest_drafted(self, tree: DraftTree) -> int:
        """The depth of ``tree``'s deepest drafted (not prompt-lookup) node; 0 for a lookup chain alone."""
        drafted = tree.depth[~self._is_lookup(tree)]
        return int(drafted.max()) if drafted.numel() else 0

    def _on_chain(self, tree: DraftTree) -> torch.Tensor:
        """[N] bool: the nodes of the prompt-lookup chain, the drafted nodes it shares included (the ancestors
        of the node the first lookup node hangs from); a shallower tree would carry them too."""
        lookup = self._is_lookup(tree)
        m = int(lookup.sum())
        if not m:
            return lookup
        return lookup | tree.mask[int(tree.parent[tree.size - m])].cpu()

    def chance(self, tree: DraftTree) -> torch.Tensor:
        """[N - 1] predicted acceptance chance of each non-root node (see the class docstring)."""
        bins = self._bin(tree.score)
        lookup = self._is_lookup(tree)
        chance = torch.where(lookup, self.rates("lookup")[bins], self.rates("draft")[bins])
        chance[0] = 1.0
        return torch.where(tree.mask.cpu(), chance[None, :], torch.inf).min(1).values[1:]

    def choose(self, tree: DraftTree, draft_s: float, others: tuple = Others()) -> DraftTree | None:
        """The ``n`` nodes of ``tree`` most likely accepted, for the n that maximises expected tokens per
        second, or None when a plain step (n = 1) does; every ``explore_every``-th call twice that many nodes
        (at least 4, at most the tree).
        ``others``: the other requests of the same forward (:class:`Others`)."""
        if tree.size <= 1:
            return None
        self._drafted += 1
        self._drafted_depth = self._deepest_drafted(tree)
        explore = bool(self.explore_every) and self._drafted % self.explore_every == 0
        chance = self.chance(tree)
        order = torch.sort(chance, descending=True, stable=True).indices
        rows, tokens, waits, peers = Others(*others)
        n = 1 + peers
        expected = n * torch.cat([torch.ones(1, dtype=torch.float64), 1.0 + chance[order].cumsum(0)]) + tokens
        sizes = torch.arange(1, tree.size + 1, dtype=torch.float64)
        seconds = self.scale * self._cost().verify(n * sizes + rows) + n * draft_s + waits
        n = int((expected / seconds).argmax()) + 1
        if explore:
            n = min(tree.size, max(2 * n, 4))
        self.chosen.append(n)
        if n == 1:
            return None
        if n == tree.size:
            return tree
        keep = torch.cat([order.new_zeros(1), 1 + order[:n - 1]]).sort().values
        return tree.select(keep.to(tree.tokens.device))

    def observe(self, tree: DraftTree | None, path: torch.Tensor | None, draft_s: float | None,
                verify_s: float | None = None, rows: int = 0) -> None:
        """After a step: the verified ``tree`` (None: a plain step), its accepted ``path`` (node indices, root
        first; ignored for a plain step), the seconds spent drafting it (None: not a step's drafting alone --
        a request's first drafted step also runs its prompt through the drafter, a per-request cost like a
        prefill, and a drafter's first use sets it up), and the verification forward's own ``verify_s`` with
        the ``rows`` of other requests in it (they update :attr:`scale`)."""
        w = 0.8
        if verify_s is not None:
            ratio = verify_s / max(self._cost().verify_one(rows + (1 if tree is None else tree.size)), 1e-9)
            self.scale = ratio if self._scaled == 0 else w * self.scale + (1 - w) * ratio
            self._scaled += 1
            if not self._judged and self._scaled >= STALE_AFTER:
                self._judged = True
                if self.scale < STALE_SCALE and retire_cost_model(self._cost()):
                    log.warning("the cached cost model predicted verifications %.1fx slower than they run (measured "
                                "on a busy machine?): removed from the cache; taps calibrate measures it again",
                                1 / self.scale)
        if tree is None or path is None:
            return
        lookup = self._is_lookup(tree)[1:]
        bins = self._bin(tree.score[1:])
        accepted = torch.zeros(tree.size, dtype=torch.float64)
        accepted[path.cpu()] = 1.0
        size = len(SCORE_EDGES) + 1
        for kind, mask in (("draft", ~lookup), ("lookup", lookup)):
            self._seen[kind] = self.decay * self._seen[kind] + torch.bincount(bins[mask], minlength=size).double()
            self._hits[kind] = self.decay * self._hits[kind] + torch.bincount(
                bins[mask], weights=accepted[1:][mask], minlength=size)
        self._drafted_steps += 1
        drafted = self._drafted_depth if self._drafted_depth is not None else self._deepest_drafted(tree)
        self._drafted_depth = None
        if drafted < 1:
            return
        depth, path = tree.depth.cpu(), path.cpu()
        carried = self._on_chain(tree)
        for d in range(1, drafted + 1):
            kept = (depth <= d) | carried
            stats = self._depths.setdefault(d, _DepthStats())
            gain, nodes = 1.0 + float(kept[path[1:]].cumprod(0).sum()), float(kept.sum())
            first = stats.seen == 0
            stats.gain = gain if first else w * stats.gain + (1 - w) * gain
            stats.nodes = nodes if first else w * stats.nodes + (1 - w) * nodes
            stats.seen += 1
        if draft_s is not None:
            stats = self._depths[drafted]
            stats.draft_s = draft_s if not stats.timed else w * stats.draft_s + (1 - w) * draft_s
            stats.timed += 1
