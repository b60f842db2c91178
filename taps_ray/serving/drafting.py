"""Drafting over remote drafters: the :class:`RemoteStrategy` a served request decodes with.

The loop is :func:`taps_ray.spec.decoder.generate`, unchanged: a :class:`RemoteStrategy` is its
``Strategy``. Each ``propose`` sends every drafter of the request's plan the pairs it has not yet
confirmed, waits for all replies until the per-step deadline (the calls run in parallel, so a step
costs about one drafter's latency), composes the trees that arrived (single / routed / merged) and
returns the tree to verify, or None (decode one token plainly) when no drafter answered in time.
A drafter that keeps failing backs off for a growing number of steps. ``advance`` records the
accepted pairs; the output is the target's either way. Streaming, stop sequences, cancellation,
deadlines and the batch's node limit are the decode loop's (its ``observer``, ``stop``, ``cancel``,
``deadline`` and ``node_limit``); what this strategy saw in a step (who answered, who was skipped and
why, the slowest drafter's compute seconds) goes in the step's notes (``DecodeState.notes``), which the
loop keeps in the step record's ``meta``.

Routed and merged requests draft every tree over one ``support``, the union of the plan's draft
vocabularies (:func:`plan_support`; None when they share one), as the in-process strategies do, so the
routing signals and budget scores compare and the served trees equal the in-process ones. The
:class:`~taps_ray.serving.verifier.Verifier` computes it once per set of drafters and sends it with
the call that opens each drafting session.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from taps_ray.config import TreeConfig
from taps_ray.models.target import TargetModel, layer_columns, union_layers
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
                support: torch.Tensor | None = None, depth: int | None = None) -> Reply: ...

    def vocabulary(self) -> Reply: ...

    def layers(self) -> Reply: ...

    def end(self, rid: str) -> None: ...


class HandleClient:
    """A :class:`DrafterClient` over a Ray Serve deployment handle of :class:`~taps_ray.serving.drafter.Drafter`."""

    def __init__(self, handle):
        self.handle = handle

    def propose(self, rid: str, offset: int, tokens: torch.Tensor, features: torch.Tensor,
                support: torch.Tensor | None = None, depth: int | None = None) -> Reply:
        return _HandleReply(self.handle.propose.remote(rid, offset, tokens, features, support, depth))

    def vocabulary(self) -> Reply:
        return _HandleReply(self.handle.vocabulary.remote())

    def layers(self) -> Reply:
        return _HandleReply(self.handle.layers.remote())

    def end(self, rid: str) -> None:
        self.handle.end.remote(rid)


class _HandleReply:
    def __init__(self, response):
        self.response = response

    def result(self, timeout: float) -> dict:
        return self.response.result(timeout_s=max(timeout, 1e-3))


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
    vocabularies = list(ask_drafters(plan.drafters, clients, lambda c: c.vocabulary(), "draft vocabulary",
                                     timeout_s).values())
    if not vocabularies:
        return None, False
    support = union_support(vocabularies, vocab_size)
    if len(vocabularies) == len(plan.drafters):
        return support, True
    if support is None:  # the drafters that answered share one vocabulary: name it, the others may differ
        support = torch.arange(vocab_size) if vocabularies[0] is None else vocabularies[0].sort().values
    return support, False


def ask_drafters(names, clients: dict[str, DrafterClient], question: Callable, what: str,
                 timeout_s: float) -> dict[str, Any]:
    """``question(client)`` (a call returning a future) of each drafter of ``names``, asked in parallel: the
    answers within ``timeout_s``, by drafter; a drafter that fails or does not answer in time is left out
    (logged as failing to tell its ``what``)."""
    deadline = time.monotonic() + timeout_s
    pending, answers = {}, {}
    for name in names:
        try:
            pending[name] = question(clients[name])
        except Exception as err:
            log.warning("drafter %s: asking its %s failed: %r", name, what, err)
    for name, reply in pending.items():
        try:
            answers[name] = reply.result(deadline - time.monotonic())
        except Exception as err:
            log.warning("drafter %s: asking its %s failed: %r", name, what, err)
    return answers


def drafter_layers(names, clients: dict[str, DrafterClient], timeout_s: float) -> dict[str, tuple[int, ...]]:
    """The target hidden states each drafter of ``names`` reads (its ``feature_layers``), asked in parallel;
    a drafter that does not answer within ``timeout_s`` is left out (logged)."""
    answers = ask_drafters(names, clients, lambda c: c.layers(), "feature layers", timeout_s)
    return {name: tuple(int(i) for i in layers) for name, layers in answers.items()}


class RemoteStrategy:
    """A :class:`~taps_ray.spec.protocol.Strategy` whose drafters live elsewhere (see module docs).

    ``lookup`` (its ``lookup_*`` fields; None: none) grafts prompt-lookup chains onto the composed tree,
    or proposes the chain alone when no drafter answered (:mod:`taps_ray.spec.lookup`).
    ``support`` (:func:`plan_support`): the target ids every drafting session of this request drafts
    over (sent with the call that opens a session); a drafter that cannot draft over it, or answers a
    tree over another support, is skipped (``vocabulary``). A step the loop decodes plainly without
    asking (its node limit) costs the drafters nothing: the pairs they miss go with their next call.
    Each step's notes: ``answered`` (drafters whose tree arrived), ``skipped`` (name -> reason) and
    ``compute_s`` (the slowest answering drafter's own seconds).
    ``layers`` (drafter name -> the target hidden states it reads, for every drafter of the plan; None: all
    read the last hidden state): the strategy's ``feature_layers`` is their union, and each drafter is sent
    its own layers' columns of the features (ValueError when ``layers`` misses a drafter of the plan).
    """

    def __init__(self, rid: str, plan: Plan, clients: dict[str, DrafterClient], deadline_s: float,
                 total_tokens: int, probe_steps: int = 2, recheck_every: int = 0, lookup: TreeConfig | None = None,
                 support: torch.Tensor | None = None, layers: dict[str, tuple[int, ...]] | None = None):
        self.name = plan.name
        missing = [name for name in plan.drafters if layers is not None and name not in layers]
        if missing:
            raise ValueError(f"no feature layers for drafter(s) {missing} of plan {plan.name!r}")
        self.layers = {name: tuple(layers[name]) for name in plan.drafters} if layers is not None else {}
        self.feature_layers = union_layers(self.layers.values())
        self._columns: dict[str, torch.Tensor | None] = {}
        self.support = support
        self._recorded = support
        self.lookup = lookup or TreeConfig(lookup_tokens=0)
        self.rid = rid
        self.plan = plan
        self.names = list(plan.drafters)
        self.clients = clients
        self.deadline_s = deadline_s
        self.total_tokens = total_tokens
        self.route = RequestRoute(plan.spec.signal, probe_steps, recheck_every) \
            if plan.kind == "routed" and plan.spec.granularity == "request" else None
        self.contacted: set[str] = set()
        self.sent: dict[str, int] = {}
        self.failures: Counter = Counter()
        self.resume_at: dict[str, int] = {}
        self.skips: dict[str, Counter] = defaultdict(Counter)
        self.device = torch.device("cpu")
        self._tokens = torch.empty(0, dtype=torch.long)
        self._features = torch.empty(0)
        self.length = 0

    def start(self, target: TargetModel, tokens: torch.Tensor, features: torch.Tensor) -> None:
        self.device = target.device
        if self.feature_layers is not None and target.feature_layers(self.feature_layers):
            have = tuple(self.feature_layers)
            self._columns = {name: layer_columns(have, own, target.hidden_size)
                             for name, own in self.layers.items() if own != have}
        if self.support is not None and self.support.numel() == target.vocab_size:
            self._recorded = None  # the tree records the whole target vocabulary as None
        n = tokens.numel()
        self._tokens = torch.empty(max(2 * n, 64), dtype=torch.long)
        self._features = torch.empty(self._tokens.numel(), features.shape[-1], dtype=features.dtype)
        self._append(tokens.cpu(), features.cpu())
        self.sent = {name: 0 for name in self.names}
        self._depth: int | None = None

    def propose(self, state: DecodeState) -> DraftTree | None:
        notes = state.notes
        notes.update(answered=[], skipped={}, compute_s=0.0, adapted=False)
        if not self.names:
            return None
        step = state.step
        probe = self.route is None or self.route.probing(step)
        drafting = list(self.names) if probe else [self.names[self.route.choice]]
        for name in [n for n in drafting if self.resume_at.get(n, 0) > step]:
            self._skip(notes, step, name, "backoff")
            drafting.remove(name)
        self._depth = state.depth
        got = self._gather(drafting, notes, step)
        root = int(state.tokens[-1])
        for name in list(got):
            if got[name].prefix_len != state.prefix_len or int(got[name].tokens[0]) != root:
                self._skip(notes, step, name, "stale")
                del got[name]
        self._drop_other_supports(got, notes, step)
        if not got:
            return graft_lookup(None, state.tokens, self.lookup)
        tree, meta = compose_trees(self.plan.spec, [got.get(n) for n in self.names], self.names, self.total_tokens)
        if self.plan.kind == "routed":
            meta["probe"] = probe
        if self.route is not None:
            meta["decision"] = self._decide(meta["signals"]) if probe else self.names[self.route.choice]
        tree.meta = {**tree.meta, **meta}
        return graft_lookup(tree.to(self.device), state.tokens, self.lookup)

    def _drop_other_supports(self, got: dict[str, DraftTree], notes: dict, step: int) -> None:
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
                self._skip(notes, step, name, "vocabulary")
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

    def _send(self, name: str, offset: int) -> Reply:
        self.contacted.add(name)
        end = self.length
        features = self._features[offset:end]
        columns = self._columns.get(name)
        return self.clients[name].propose(self.rid, offset, self._tokens[offset:end].clone(),
                                          features.clone() if columns is None else features[:, columns],
                                          self.support if offset == 0 else None, depth=self._depth)

    def _gather(self, names: list[str], notes: dict, step: int) -> dict[str, DraftTree]:
        deadline = time.monotonic() + self.deadline_s
        pending: dict[str, Reply] = {}
        for name in names:
            try:
                pending[name] = self._send(name, self.sent[name])
            except Exception as err:
                self._skip(notes, step, name, "error", err)
        trees: dict[str, DraftTree] = {}
        for attempt in range(2):
            resend: dict[str, Reply] = {}
            for name, reply in pending.items():
                try:
                    answer = reply.result(deadline - time.monotonic())
                except TimeoutError:
                    self._skip(notes, step, name, "deadline")
                    continue
                except Exception as err:
                    self._skip(notes, step, name, "error", err)
                    continue
                if "need" in answer:
                    self.sent[name] = answer["need"]
                    if attempt == 0:
                        try:
                            resend[name] = self._send(name, answer["need"])
                        except Exception as err:
                            self._skip(notes, step, name, "error", err)
                    else:
                        self._skip(notes, step, name, "resync")
                elif "unsupported" in answer:
                    self._skip(notes, step, name, "vocabulary", answer["unsupported"])
                elif "tree" in answer:
                    self.sent[name] = answer["held"]
                    self.failures[name] = 0
                    trees[name] = answer["tree"]
                    notes["answered"].append(name)
                    notes["compute_s"] = max(notes["compute_s"], answer.get("compute_s", 0.0))
                    notes["adapted"] = notes["adapted"] or bool(answer.get("adapted"))
                else:
                    self._skip(notes, step, name, "stale")
            pending = resend
        return trees

    def _skip(self, notes: dict, step: int, name: str, reason: str, err: Exception | None = None) -> None:
        """Skip ``name`` at ``step``; after k failures in a row it also sits out the next 2^(k-1) - 1 steps
        (at most 15), so a dead or stalled drafter costs a deadline only now and then."""
        notes["skipped"][name] = reason
        if reason != "backoff":
            self.failures[name] += 1
            self.resume_at[name] = step + min(2 ** (self.failures[name] - 1), 16)
        first = not self.skips[name]
        self.skips[name][reason] += 1
        (log.warning if first else log.debug)("request %s step %d: drafter %s skipped (%s%s)", self.rid,
                                               step + 1, name, reason, f": {err!r}" if err else "")
