"""Drafting over remote drafters: the :class:`RemoteStrategy` a served request decodes with.

The loop is :func:`taps_ray.spec.decoder.generate`, unchanged: a :class:`RemoteStrategy` is its
``Strategy``. Each ``propose`` sends every drafter of the request's plan the pairs it has not yet
confirmed, waits for all replies until the per-step deadline (the calls run in parallel, so a step
costs about one drafter's latency), composes the trees that arrived (single / routed / merged) and
returns the tree to verify, or None (decode one token plainly) when no drafter answered in time.
A drafter that keeps failing backs off for a growing number of steps. ``advance`` records the
accepted pairs and streams the new tokens out; the output is the target's either way.

Routed and merged requests draft every tree over one ``support``, the union of the plan's draft
vocabularies (:func:`plan_support`; None when they share one), as the in-process strategies do, so the
routing signals and budget scores compare and the served trees equal the in-process ones. The
:class:`~taps_ray.serving.verifier.Verifier` computes it once per set of drafters and sends it with
the call that opens each drafting session.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from taps_ray.config import TreeConfig
from taps_ray.models.target import TargetModel
from taps_ray.serving.plan import Plan
from taps_ray.spec.compose import RequestRoute, compose_trees, union_support
from taps_ray.spec.lookup import graft_lookup
from taps_ray.spec.protocol import DecodeState
from taps_ray.spec.tree import DraftTree, same_support

log = logging.getLogger(__name__)


class Reply(Protocol):
    def result(self, timeout: float) -> dict: ...


class DrafterClient(Protocol):
    """A drafter as the verifier sees it (a deployment handle, or a local object in tests)."""

    def propose(self, rid: str, offset: int, tokens: torch.Tensor, features: torch.Tensor,
                support: torch.Tensor | None = None) -> Reply: ...

    def vocabulary(self) -> Reply: ...

    def end(self, rid: str) -> None: ...


class HandleClient:
    """A :class:`DrafterClient` over a Ray Serve deployment handle of :class:`~taps_ray.serving.drafter.Drafter`."""

    def __init__(self, handle):
        self.handle = handle

    def propose(self, rid: str, offset: int, tokens: torch.Tensor, features: torch.Tensor,
                support: torch.Tensor | None = None) -> Reply:
        return _HandleReply(self.handle.propose.remote(rid, offset, tokens, features, support))

    def vocabulary(self) -> Reply:
        return _HandleReply(self.handle.vocabulary.remote())

    def end(self, rid: str) -> None:
        self.handle.end.remote(rid)


class _HandleReply:
    def __init__(self, response):
        self.response = response

    def result(self, timeout: float) -> dict:
        return self.response.result(timeout_s=max(timeout, 1e-3))


class StopGeneration(Exception):
    """Ends a decode loop early: ``reason`` is ``stop`` (a stop sequence), ``cancelled`` or ``timeout``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class StepInfo:
    """What the strategy saw in one step: the tree size verified (1: plain), who answered, who was
    skipped and why, the route taken, the slowest answering drafter's compute seconds, the nodes
    cut from the tree to fit the load budget (``shed``) or whether the budget made the step plain
    without drafting (``load_plain``); ``accepted`` and ``appended`` (the tokens handed over: accepted + bonus) are filled by ``advance``."""

    tree_size: int = 1
    answered: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    route: str | None = None
    accepted: int | None = None
    appended: int | None = None
    compute_s: float = 0.0
    shed: int = 0
    load_plain: bool = False


def needs_support(plan: Plan) -> bool:
    """Whether ``plan`` drafts over the union of its drafters' vocabularies: routed and merged plans of
    two or more drafters, as :class:`~taps_ray.spec.compose.RoutedStrategy` / ``MergedStrategy`` do."""
    return plan.kind in ("routed", "merged") and len(plan.drafters) > 1


def plan_support(plan: Plan, clients: dict[str, DrafterClient], vocab_size: int,
                 timeout_s: float) -> tuple[torch.Tensor | None, bool]:
    """``(support, complete)``: the support ``plan``'s trees are drafted over (None: each drafter's own
    vocabulary, for plans that compare no scores or drafters that share one vocabulary), from the draft
    vocabularies the drafters report within ``timeout_s`` (asked in parallel). ``complete`` is False
    when a drafter did not answer: the support then covers only those that did (a drafter it misses
    answers ``unsupported`` and is skipped), and should not be kept."""
    if not needs_support(plan):
        return None, True
    deadline = time.monotonic() + timeout_s
    pending, vocabularies = {}, []
    for name in plan.drafters:
        try:
            pending[name] = clients[name].vocabulary()
        except Exception as err:
            log.warning("drafter %s: asking its draft vocabulary failed: %r", name, err)
    for name, reply in pending.items():
        try:
            vocabularies.append(reply.result(deadline - time.monotonic()))
        except Exception as err:
            log.warning("drafter %s: asking its draft vocabulary failed: %r", name, err)
    if not vocabularies:
        return None, False
    support = union_support(vocabularies, vocab_size)
    if len(vocabularies) == len(plan.drafters):
        return support, True
    if support is None:  # the drafters that answered share one vocabulary: name it, the others may differ
        support = torch.arange(vocab_size) if vocabularies[0] is None else vocabularies[0].sort().values
    return support, False


class RemoteStrategy:
    """A :class:`~taps_ray.spec.protocol.Strategy` whose drafters live elsewhere (see module docs).

    ``on_tokens`` receives the token ids the loop commits (the first token, then each step's accepted +
    bonus tokens; the last step's come back with the loop's result) and may raise :class:`StopGeneration`.
    ``cancel`` / ``expires`` (monotonic time) stop the loop with reason ``cancelled`` / ``timeout``.
    ``lookup`` (its ``lookup_*`` fields; None: none) grafts prompt-lookup chains onto the composed tree,
    or proposes the chain alone when no drafter answered (:mod:`taps_ray.spec.lookup`).
    ``support`` (:func:`plan_support`): the target ids every drafting session of this request drafts
    over (sent with the call that opens a session); a drafter that cannot draft over it, or answers a
    tree over another support, is skipped (``vocabulary``). ``node_budget`` (None: no limit) gives, each
    step, the most nodes the tree to verify may have: a larger one is cut to its best-scored nodes
    (:meth:`DraftTree.top`), and a budget of 1 decodes the step plainly without asking any drafter
    (the pairs they miss are sent with their next call).
    """

    def __init__(self, rid: str, plan: Plan, clients: dict[str, DrafterClient], deadline_s: float,
                 total_tokens: int, on_tokens: Callable[[list[int]], None] | None = None,
                 cancel: threading.Event | None = None, expires: float | None = None,
                 probe_steps: int = 2, recheck_every: int = 0, lookup: TreeConfig | None = None,
                 support: torch.Tensor | None = None, node_budget: Callable[[], int] | None = None):
        self.name = plan.name
        self.node_budget = node_budget
        self.support = support
        self._recorded = support
        self.lookup = lookup or TreeConfig(lookup_tokens=0)
        self.rid = rid
        self.plan = plan
        self.names = list(plan.drafters)
        self.clients = clients
        self.deadline_s = deadline_s
        self.total_tokens = total_tokens
        self.on_tokens = on_tokens
        self.cancel = cancel
        self.expires = expires
        self.route = RequestRoute(plan.spec.signal, probe_steps, recheck_every) \
            if plan.kind == "routed" and plan.spec.granularity == "request" else None
        self.contacted: set[str] = set()
        self.sent: dict[str, int] = {}
        self.failures: Counter = Counter()
        self.resume_at: dict[str, int] = {}
        self.steps: list[StepInfo] = []
        self._proposed = False
        self.skips: dict[str, Counter] = defaultdict(Counter)
        self.device = torch.device("cpu")
        self._tokens = torch.empty(0, dtype=torch.long)
        self._features = torch.empty(0)
        self.length = 0

    def start(self, target: TargetModel, tokens: torch.Tensor, features: torch.Tensor) -> None:
        self.device = target.device
        if self.support is not None and self.support.numel() == target.vocab_size:
            self._recorded = None  # the tree records the whole target vocabulary as None
        n = tokens.numel()
        self._tokens = torch.empty(max(2 * n, 64), dtype=torch.long)
        self._features = torch.empty(self._tokens.numel(), features.shape[-1], dtype=features.dtype)
        self._append(tokens.cpu(), features.cpu())
        self.sent = {name: 0 for name in self.names}
        self._emit(tokens[-1:])

    def propose(self, state: DecodeState) -> DraftTree | None:
        self._check()
        info = StepInfo()
        self.steps.append(info)
        self._proposed = True
        if not self.names:
            return None
        budget = None if self.node_budget is None else max(1, self.node_budget())
        if budget == 1:
            info.load_plain = True
            return None
        step = len(self.steps) - 1
        probe = self.route is None or self.route.probing(step)
        drafting = list(self.names) if probe else [self.names[self.route.choice]]
        for name in [n for n in drafting if self.resume_at.get(n, 0) > step]:
            self._skip(info, name, "backoff")
            drafting.remove(name)
        got = self._gather(drafting, info)
        root = int(state.tokens[-1])
        for name in list(got):
            if got[name].prefix_len != state.prefix_len or int(got[name].tokens[0]) != root:
                self._skip(info, name, "stale")
                del got[name]
        self._drop_other_supports(got, info)
        if not got:
            return self._fit(graft_lookup(None, state.tokens, self.lookup), budget, info)
        tree, meta = compose_trees(self.plan.spec, [got.get(n) for n in self.names], self.names, self.total_tokens)
        if self.plan.kind == "routed":
            meta["probe"] = probe
        if self.route is not None:
            meta["decision"] = self._decide(meta["signals"]) if probe else self.names[self.route.choice]
        info.route = meta.get("route")
        info.tree_size = tree.size
        tree.meta = {**tree.meta, **meta, "answered": list(got)}
        return self._fit(graft_lookup(tree.to(self.device), state.tokens, self.lookup), budget, info)

    @staticmethod
    def _fit(tree: DraftTree | None, budget: int | None, info: StepInfo) -> DraftTree | None:
        """``tree`` cut to its best ``budget`` nodes (None: no budget)."""
        if tree is None or budget is None or tree.size <= budget:
            return tree
        info.shed, info.tree_size = tree.size - budget, budget
        return tree.top(budget)

    def _drop_other_supports(self, got: dict[str, DraftTree], info: StepInfo) -> None:
        """Skip (``vocabulary``) the trees not drafted over this request's support, so composition never
        compares signals over different supports. Without a support (none was needed, or no drafter
        reported its vocabulary in time), plans that compare signals keep the trees over the support of
        the first drafter that answered."""
        if self.support is not None:
            expected = self._recorded
        elif self.plan.kind == "routed" or (self.plan.kind == "merged" and self.plan.spec.merge == "budget"):
            first = next((n for n in self.names if n in got), None)
            expected = got[first].support if first is not None else None
        else:
            return
        for name in list(got):
            if not same_support(got[name].support, expected):
                self._skip(info, name, "vocabulary")
                del got[name]

    def _decide(self, signals: torch.Tensor) -> str | None:
        """Feed a probe step's signals to the request route; once it decides (and never rechecks),
        free the sessions of the drafters it left out."""
        choice = self.route.observe(signals)
        if choice is None:
            return None
        if self.route.recheck_every == 0:
            for i, name in enumerate(self.names):
                if i != choice and name in self.contacted:
                    self.clients[name].end(self.rid)
                    self.contacted.discard(name)
        return self.names[choice]

    def advance(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        self._append(tokens.cpu(), features.cpu())
        if not self._proposed:
            self.steps.append(StepInfo())
        self._proposed = False
        if self.steps:
            self.steps[-1].accepted, self.steps[-1].appended = tokens.numel() - 1, tokens.numel()
        self._emit(tokens)
        self._check()

    def close(self) -> None:
        """Free this request's drafting sessions."""
        for name in self.contacted:
            try:
                self.clients[name].end(self.rid)
            except Exception as err:
                log.info("request %s: ending the session on drafter %s failed: %s", self.rid, name, err)

    @property
    def skip_counts(self) -> dict[str, dict[str, int]]:
        return {name: dict(c) for name, c in self.skips.items()}

    def _append(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        n = tokens.numel()
        if self.length + n > self._tokens.numel():
            size = 2 * (self.length + n)
            self._tokens = torch.cat([self._tokens[:self.length], self._tokens.new_empty(size - self.length)])
            self._features = torch.cat([self._features[:self.length],
                                        self._features.new_empty(size - self.length, self._features.shape[1])])
        self._tokens[self.length:self.length + n] = tokens.reshape(-1)
        self._features[self.length:self.length + n] = features.reshape(n, -1)
        self.length += n

    def _emit(self, tokens: torch.Tensor) -> None:
        if self.on_tokens is not None:
            self.on_tokens(tokens.tolist())

    def _check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise StopGeneration("cancelled")
        if self.expires is not None and time.monotonic() > self.expires:
            raise StopGeneration("timeout")

    def _send(self, name: str, offset: int) -> Reply:
        self.contacted.add(name)
        end = self.length
        return self.clients[name].propose(self.rid, offset, self._tokens[offset:end].clone(),
                                          self._features[offset:end].clone(),
                                          self.support if offset == 0 else None)

    def _gather(self, names: list[str], info: StepInfo) -> dict[str, DraftTree]:
        deadline = time.monotonic() + self.deadline_s
        pending: dict[str, Reply] = {}
        for name in names:
            try:
                pending[name] = self._send(name, self.sent[name])
            except Exception as err:
                self._skip(info, name, "error", err)
        trees: dict[str, DraftTree] = {}
        for attempt in range(2):
            resend: dict[str, Reply] = {}
            for name, reply in pending.items():
                try:
                    answer = reply.result(deadline - time.monotonic())
                except TimeoutError:
                    self._skip(info, name, "deadline")
                    continue
                except Exception as err:
                    self._skip(info, name, "error", err)
                    continue
                if "need" in answer:
                    self.sent[name] = answer["need"]
                    if attempt == 0:
                        try:
                            resend[name] = self._send(name, answer["need"])
                        except Exception as err:
                            self._skip(info, name, "error", err)
                    else:
                        self._skip(info, name, "resync")
                elif "unsupported" in answer:
                    self._skip(info, name, "vocabulary", answer["unsupported"])
                elif "tree" in answer:
                    self.sent[name] = answer["held"]
                    self.failures[name] = 0
                    trees[name] = answer["tree"]
                    info.answered.append(name)
                    info.compute_s = max(info.compute_s, answer.get("compute_s", 0.0))
                else:
                    self._skip(info, name, "stale")
            pending = resend
        return trees

    def _skip(self, info: StepInfo, name: str, reason: str, err: Exception | None = None) -> None:
        """Skip ``name`` this step; after k failures in a row it also sits out the next 2^(k-1) - 1 steps
        (at most 15), so a dead or stalled drafter costs a deadline only now and then."""
        info.skipped[name] = reason
        if reason != "backoff":
            self.failures[name] += 1
            self.resume_at[name] = len(self.steps) + min(2 ** (self.failures[name] - 1), 16) - 1
        first = not self.skips[name]
        self.skips[name][reason] += 1
        (log.warning if first else log.debug)("request %s step %d: drafter %s skipped (%s%s)", self.rid,
                                               len(self.steps), name, reason, f": {err!r}" if err else "")
