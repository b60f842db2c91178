"""Verifier deployment: the target model and the decode loop over remote drafters.

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
:class:`Verifier` computes it once per set of drafters and sends it with the call that opens each
drafting session.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from taps_ray.config import ServeConfig, TargetConfig, TreeConfig
from taps_ray.models.target import TargetModel
from taps_ray.serving.drafter import rss_bytes
from taps_ray.serving.logprobs import LogprobStream, TokenPieces
from taps_ray.serving.plan import DecodeRequest, Plan
from taps_ray.serving.protocol import RequestError
from taps_ray.spec import stats
from taps_ray.spec.compose import RequestRoute, compose_trees, union_support
from taps_ray.spec.decoder import check_sampling, generate
from taps_ray.spec.lookup import graft_lookup
from taps_ray.spec.protocol import DecodeState
from taps_ray.spec.stats import StepRecord
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
    skipped and why, the route taken, the slowest answering drafter's compute seconds;
    ``accepted`` and ``appended`` (the tokens handed over: accepted + bonus) are filled by ``advance``."""

    tree_size: int = 1
    answered: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    route: str | None = None
    accepted: int | None = None
    appended: int | None = None
    compute_s: float = 0.0


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
    tree over another support, is skipped (``vocabulary``).
    """

    def __init__(self, rid: str, plan: Plan, clients: dict[str, DrafterClient], deadline_s: float,
                 total_tokens: int, on_tokens: Callable[[list[int]], None] | None = None,
                 cancel: threading.Event | None = None, expires: float | None = None,
                 probe_steps: int = 2, recheck_every: int = 0, lookup: TreeConfig | None = None,
                 support: torch.Tensor | None = None):
        self.name = plan.name
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
        if not self.names:
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
            return graft_lookup(None, state.tokens, self.lookup)
        tree, meta = compose_trees(self.plan.spec, [got.get(n) for n in self.names], self.names, self.total_tokens)
        if self.plan.kind == "routed":
            meta["probe"] = probe
        if self.route is not None:
            meta["decision"] = self._decide(meta["signals"]) if probe else self.names[self.route.choice]
        info.route = meta.get("route")
        info.tree_size = tree.size
        tree.meta = {**tree.meta, **meta, "answered": list(got)}
        return graft_lookup(tree.to(self.device), state.tokens, self.lookup)

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


class TextStream:
    """Incremental detokenization with stop sequences.

    :meth:`push` takes committed token ids and returns the text that is safe to send: it holds back
    a tail that may still grow into a stop sequence and an incomplete character at the end. After
    a stop sequence, ``hit`` is set, the text ends before it and ``used`` counts the tokens consumed.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.window = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.hit = False

    @property
    def used(self) -> int:
        return len(self.ids)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _pending_stop(self) -> int:
        """Length of the longest tail of the text that begins a stop sequence."""
        for k in range(min(self.window, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stop):
                return k
        return 0

    def push(self, ids: list[int]) -> str:
        if self.hit or not ids:
            return ""
        if not self.stop:
            self.ids += ids
            self.text = self._decode()
        else:
            for token in ids:
                self.ids.append(token)
                text = self._decode()
                start = max(0, len(self.text) - self.window)
                found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
                if found:
                    self.text, self.hit = text[:min(found)], True
                    break
                self.text = text
        safe = len(self.text) if self.hit else len(self.text) - self._pending_stop()
        while not self.hit and safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:safe], safe
        return delta

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta


async def _settle(done: asyncio.Future) -> None:
    """Wait for ``done`` (a decode loop told to stop, so within one step) even if cancelled meanwhile, so
    the caller's slot is not handed on while the loop still runs; the cancellation is then re-raised."""
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:
            break
    if cancelled:
        raise asyncio.CancelledError


def summarize(plan: Plan, steps: list[StepInfo], skips: dict, prefill_s: float | None, total_s: float,
              records: list[StepRecord] | None = None, completion_tokens: int | None = None) -> dict:
    """The response's ``taps`` block (and what the metrics count). ``records`` (the loop's step
    records, when it ran to the end) give the accepted and appended counts and the time spent
    waiting for drafts (``draft_s``: calls, transfer and drafting; ``drafter_compute_s`` of it was
    the drafters' own work: adding the accepted pairs and drafting) and verifying (``verify_s``);
    else ``steps`` give the counts. ``completion_tokens``: the tokens the response kept, the first
    one (from the prefill) included; the appended counts are trimmed to them
    (:func:`~taps_ray.spec.stats.stop_trimmed`) when a stop sequence ended the response earlier."""
    if records is not None:
        accepted, appended = [r.accepted for r in records], [r.appended for r in records]
    else:
        accepted = [s.accepted or 0 for s in steps]
        appended = [s.appended or 0 for s in steps]
    if completion_tokens is not None:
        appended = stats.stop_trimmed(appended, max(completion_tokens - 1, 0))
    tau = stats.acceptance_length(sum(appended), len(appended))
    routes = [s.route for s in steps if s.route is not None]
    out = {
        "strategy": plan.name, "drafters": list(plan.drafters), "steps": len(steps),
        "tau": None if math.isnan(tau) else tau,
        "accept_lengths": accepted,
        "draft_tokens": sum(s.tree_size - 1 for s in steps),
        "accepted_tokens": sum(accepted),
        "drafted_steps": sum(s.tree_size > 1 for s in steps),
        "plain_steps": sum(s.tree_size <= 1 for s in steps),
        "route_decisions": dict(Counter(routes)),
        "skipped": skips,
        "prefill_s": None if prefill_s is None else round(prefill_s, 4), "total_s": round(total_s, 4),
        "drafter_compute_s": round(sum(s.compute_s for s in steps), 4),
    }
    if records is not None:
        out["draft_s"] = round(sum(r.draft_s for r in records), 4)
        out["verify_s"] = round(sum(r.verify_s for r in records), 4)
    if plan.kind == "routed":
        out["route_per_step"] = [s.route for s in steps]
    return out


class Verifier:
    """Ray Serve deployment body holding the target (see :mod:`taps_ray.serving.app`).

    :meth:`generate` streams events for one request: ``start`` (prompt tokens, max tokens) or
    ``error`` first, then ``delta`` texts, then ``done`` (finish reason, usage, ``taps`` block). When the
    request asks for logprobs, each ``delta`` and ``done`` also carries ``logprobs``: the entries
    (:mod:`taps_ray.serving.logprobs`) of the tokens consumed since the last one.

    Cancellation frees the machine: when the caller goes away (the client hung up) or the request's
    deadline (``DecodeRequest.expires_at``, counted from its arrival) passes, its decode loop stops at
    the next step, or before prefill when it has not begun. At most ``max_concurrent_requests`` decode
    loops run per replica (a pool of that many threads), and :meth:`generate` returns only once its
    loop has ended, so a new request never decodes beside a cancelled one that is still winding down:
    it waits in the pool (``waiting``) and starts when the old loop has stopped.
    """

    def __init__(self, target: dict, tree: dict, serve: dict, drafters: dict):
        self.cfg = ServeConfig(**serve)
        target_cfg = TargetConfig(**target)
        self.target = TargetModel.load(target_cfg)
        self.tree = TreeConfig(**tree)
        self.clients: dict[str, DrafterClient] = {name: HandleClient(h) for name, h in drafters.items()}
        self.pool = ThreadPoolExecutor(self.cfg.max_concurrent_requests, thread_name_prefix="taps-decode")
        self.pieces = TokenPieces(self.target.tokenizer) if self.target.tokenizer is not None else None
        self._init_counts()

    def _init_counts(self) -> None:
        self.active = 0
        self.waiting = 0
        self.counts: Counter = Counter()
        self._active_lock = threading.Lock()
        self._supports: dict[frozenset[str], torch.Tensor | None] = {}

    def _support(self, plan: Plan, timeout_s: float) -> torch.Tensor | None:
        """The drafting support of ``plan`` (:func:`plan_support`), computed once per set of drafters
        (kept only when every drafter reported its vocabulary; dropped by :meth:`_decode` when one
        could not draft over it, e.g. after a swap to another vocabulary)."""
        if not needs_support(plan):
            return None
        key = frozenset(plan.drafters)
        if key in self._supports:
            return self._supports[key]
        support, complete = plan_support(plan, self.clients, self.target.vocab_size, timeout_s)
        if complete:
            self._supports[key] = support
        return support

    def info(self) -> dict:
        """The target, its context length, the drafters, this replica's pid and resident memory; ``active``:
        decode loops running now (prefill included), ``waiting``: requests accepted but not yet started,
        ``outcomes``: how past requests ended (``finished``, ``refused``, ``failed``, ``cancelled`` /
        ``timeout`` while decoding, ``cancelled_before_prefill`` / ``timeout_before_prefill``)."""
        return {"model": self.target.name, "max_context": self.target.max_context, "drafters": list(self.clients),
                "pid": os.getpid(), "rss_bytes": rss_bytes(), "active": self.active, "waiting": self.waiting,
                "outcomes": dict(self.counts)}

    async def generate(self, request: DecodeRequest):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(event: dict) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        with self._active_lock:
            self.waiting += 1
        done = loop.run_in_executor(self.pool, self.decode, request, emit, cancel, True)
        try:
            while True:
                event = await queue.get()
                yield event
                if event["type"] in ("done", "error"):
                    break
        finally:
            cancel.set()
            await _settle(done)

    def decode(self, request: DecodeRequest, emit: Callable[[dict], None], cancel: threading.Event | None = None,
               queued: bool = False) -> None:
        """Run one request to completion, reporting through ``emit`` (never raises); ``queued``: it was
        counted in ``waiting`` by :meth:`generate`."""
        with self._active_lock:
            self.waiting -= queued
            self.active += 1
        outcome = "finished"
        try:
            outcome = self._decode(request, emit, cancel) or outcome
        except RequestError as err:
            outcome = getattr(err, "outcome", "timeout" if err.status == 504 else "refused")
            emit({"type": "error", "status": err.status, "message": err.message, "param": err.param,
                  "code": err.code, "error_type": err.type})
        except Exception:
            outcome = "failed"
            log.exception("request %s (%s) failed", request.request_id, request.rid)
            emit({"type": "error", "status": 500, "message": "internal error", "param": None, "code": None,
                  "error_type": "server_error"})
        finally:
            with self._active_lock:
                self.active -= 1
                self.counts[outcome] += 1

    def _decode(self, request: DecodeRequest, emit: Callable[[dict], None],
                cancel: threading.Event | None) -> str | None:
        target, clients = self.target, self.clients
        timeout = self.cfg.request_timeout_s
        expires = time.monotonic() + (timeout if request.expires_at is None else request.expires_at - time.time())

        def gone() -> str | None:
            if cancel is not None and cancel.is_set():
                return "cancelled_before_prefill"
            if time.monotonic() > expires:
                err = RequestError(f"request timed out after {timeout:g} s before decoding started", None,
                                   status=504, type="timeout_error", code="timeout")
                err.outcome = "timeout_before_prefill"
                raise err
            return None

        if stopped := gone():
            return stopped
        ids = self._prompt_ids(request)
        n, limit = len(ids), target.max_context
        if n >= limit:
            raise RequestError(f"the prompt has {n} tokens; this model's context length is {limit} tokens, so at "
                               f"most {limit - 1} prompt tokens fit", request.prompt_param,
                               code="context_length_exceeded")
        room = limit - n
        max_tokens = request.max_tokens if request.max_tokens is not None else min(self.cfg.max_tokens_default, room)
        if max_tokens > room:
            raise RequestError(f"max_tokens is {max_tokens}, but the prompt has {n} tokens and this model's context "
                               f"length is {limit}: at most {room} new tokens fit", "max_tokens",
                               code="context_length_exceeded")
        try:
            sampling = check_sampling(request.sampling)
        except ValueError as err:
            raise RequestError(str(err), str(err).split()[0]) from None
        missing = [d for d in request.plan.drafters if d not in clients]
        if missing:
            raise RequestError(f"drafter(s) {missing} are not deployed", "taps.drafters", code="drafter_not_found")
        if stopped := gone():
            return stopped
        emit({"type": "start", "prompt_tokens": n, "max_tokens": max_tokens})

        text = TextStream(target.tokenizer, request.stop)
        logprobs = LogprobStream(self.pieces, request.logprobs) if request.logprobs is not None else None
        given = 0

        def with_logprobs(event: dict) -> dict:
            """``event`` with the logprobs of the tokens the text consumed since the last event."""
            nonlocal given
            if logprobs is not None:
                event["logprobs"] = logprobs.take(text.ids[given:text.used])
                given = text.used
            return event

        def on_tokens(tokens: list[int]) -> None:
            delta = text.push(tokens)
            if delta:
                emit(with_logprobs({"type": "delta", "text": delta}))
            if text.hit:
                raise StopGeneration("stop")

        deadline = self.cfg.draft_deadline_s if request.deadline_s is None else request.deadline_s
        strategy = RemoteStrategy(request.rid, request.plan, clients, deadline, self.tree.total_tokens, on_tokens,
                                  cancel, expires, self.cfg.route_probe_steps, self.cfg.route_recheck_every,
                                  self.tree, self._support(request.plan, deadline))
        start = time.perf_counter()
        result, stopped = None, None
        try:
            result = generate(target, torch.tensor(ids), strategy, sampling, max_tokens, logprobs=request.logprobs,
                              on_logprobs=logprobs.add if logprobs is not None else None)
        except StopGeneration as stop:
            stopped = stop.reason
        finally:
            strategy.close()
            if any("vocabulary" in counts for counts in strategy.skips.values()):
                self._supports.pop(frozenset(request.plan.drafters), None)
        if stopped == "timeout":
            raise RequestError(f"request timed out after {timeout:g} s", None, status=504, type="timeout_error",
                               code="timeout")
        if stopped == "cancelled":
            return "cancelled"
        if result is not None:
            tail = result.token_ids[text.used:]
            delta = text.push(tail)
            finish = "stop" if text.hit or result.finish_reason == "eos" else "length"
            prefill_s, records = result.prefill_s, result.steps
        else:
            delta, finish, prefill_s, records = "", "stop", None, None
        delta += text.flush()
        completion = text.used
        taps = summarize(request.plan, strategy.steps, strategy.skip_counts, prefill_s, time.perf_counter() - start,
                         records, completion)
        emit(with_logprobs({"type": "done", "delta": delta, "text": text.text, "finish_reason": finish,
                            "usage": {"prompt_tokens": n, "completion_tokens": completion,
                                      "total_tokens": n + completion}, "taps": taps}))
        return None

    def _prompt_ids(self, request: DecodeRequest) -> list[int]:
        target = self.target
        prompt = request.prompt
        if isinstance(prompt, str):
            if target.tokenizer is None:
                raise RequestError("this model has no tokenizer: send token ids", request.prompt_param)
            return list(target.tokenizer(prompt)["input_ids"])
        if prompt and isinstance(prompt[0], dict):
            if target.tokenizer is None:
                raise RequestError("this model has no tokenizer: use /v1/completions with token ids",
                                   request.prompt_param)
            return target.encode_chat(prompt)[0].tolist()
        ids = [int(i) for i in prompt]
        bad = [i for i in ids if not 0 <= i < target.vocab_size]
        if bad:
            raise RequestError(f"token ids must be in [0, {target.vocab_size}), got {bad[:5]}", request.prompt_param)
        return ids
