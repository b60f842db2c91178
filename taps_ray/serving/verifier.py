"""Verifier deployment: the target model, the decode pool, and each request's checks.

:class:`Verifier` is the Ray Serve deployment body (see :mod:`taps_ray.serving.app`). A request is
checked (prompt, context room, sampling, drafters), then decoded by a
:class:`~taps_ray.serving.session.DecodeSession` over a
:class:`~taps_ray.serving.drafting.RemoteStrategy`, in a pool of ``max_concurrent_requests`` threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from taps_ray.config import SamplingConfig, ServeConfig, TargetConfig, TreeConfig
from taps_ray.data.capture import CaptureWriter, capture_dir
from taps_ray.models.target import TargetModel
from taps_ray.serving.drafter import node_id, rss_bytes
from taps_ray.serving.drafting import (
    DrafterClient,
    HandleClient,
    RemoteStrategy,
    drafter_layers,
    needs_support,
    plan_support,
)
from taps_ray.serving.logprobs import TokenPieces
from taps_ray.serving.plan import DecodeRequest, Plan
from taps_ray.serving.protocol import RequestError
from taps_ray.serving.session import DecodeSession
from taps_ray.spec.batch import BatchingTarget, ForwardBatcher
from taps_ray.spec.cost import TreeBudget, cost_model
from taps_ray.spec.decoder import check_sampling

log = logging.getLogger(__name__)
FINAL_EVENTS = ("done", "error")
ROOM_POLL_S = 0.05
"""How often a decode loop waiting for room in its event buffer checks for cancellation and its deadline."""


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

    With ``serve.capture.enabled``, finished requests are kept as training rows by a
    :class:`~taps_ray.data.capture.CaptureWriter` (its buffer is written when the replica shuts down).
    """

    capture: CaptureWriter | None = None

    def __init__(self, target: dict, tree: dict, serve: dict, drafters: dict):
        self.cfg = ServeConfig(**serve)
        target_cfg = TargetConfig(**target)
        self.target = TargetModel.load(target_cfg)
        self.tree = TreeConfig(**tree)
        self.clients: dict[str, DrafterClient] = {name: HandleClient(h) for name, h in drafters.items()}
        self.pool = ThreadPoolExecutor(self.cfg.admission.max_concurrent_requests, thread_name_prefix="taps-decode")
        self.pieces = TokenPieces(self.target.tokenizer) if self.target.tokenizer is not None else None
        if self.cfg.capture.enabled:
            folder = capture_dir(self.cfg.capture, self.cfg.app_name)
            self.capture = CaptureWriter(self.cfg.capture, folder, self.target.fingerprint.to_dict())
            log.warning("serve.capture: keeping prompts and outputs of %.0f%% of finished requests%s in %s",
                        100 * self.cfg.capture.sample_rate,
                        "" if self.cfg.capture.mode == "all" else " that ask for it (store: true)", folder)
        self._init_counts()

    def __del__(self):
        if self.capture is not None:
            try:
                self.capture.flush()
            except Exception:
                log.exception("serve.capture: writing the last buffered rows failed")

    def _init_counts(self) -> None:
        """The replica's runtime state: counts, the batcher, the cost model and tree budgets."""
        self.cost = cost_model(self.target) if self.tree.adaptive else None
        self.budgets: dict[str, TreeBudget] = {}
        self.active = 0
        self.waiting = 0
        self.stalled = 0
        self.counts: Counter = Counter()
        self._active_lock = threading.Lock()
        self._supports: dict[frozenset[str], torch.Tensor | None] = {}
        self._layers: dict[str, tuple[int, ...]] = {}
        self.batcher = ForwardBatcher(self.target, self.cfg.batching.max_requests, self.cfg.batching.wait_ms / 1000,
                                      expected=lambda: self.active - self.stalled)
        self.batched = BatchingTarget(self.target, self.batcher)

    def budget(self, plan: Plan) -> TreeBudget | None:
        """The tree budget of ``plan`` (one per strategy and drafters, shared by its requests, which all
        verify on this replica's batches), or None when ``tree.adaptive`` is off."""
        if self.cost is None or plan.kind == "vanilla":
            return None
        key = f"{plan.name}|{','.join(plan.drafters)}"
        with self._active_lock:
            if key not in self.budgets:
                self.budgets[key] = TreeBudget(self.cost)
            return self.budgets[key]

    def cost_info(self) -> dict | None:
        """The cost model the tree budgets use (None: fixed trees): a plain step's ms, each node count's
        verification cost relative to it, and what it was measured on."""
        if self.cost is None:
            return None
        key = self.cost.key
        return {"plain_step_ms": round(1e3 * self.cost.plain_s, 3), "relative": self.cost.relative(),
                **{k: key.get(k) for k in ("hardware", "dtype", "threads", "engine")}}

    def _drafter_layers(self, plan: Plan, timeout_s: float) -> dict[str, tuple[int, ...]]:
        """The target hidden states each drafter of ``plan`` reads (:func:`drafter_layers`), asked once per
        drafter (a served drafter never swaps to other layers); one that has not answered is taken to read the
        last hidden state, and asked again by the next request."""
        missing = [name for name in plan.drafters if name not in self._layers]
        if missing:
            self._layers.update(drafter_layers(missing, self.clients, timeout_s))
        return {name: self._layers.get(name, (self.target.final_layer,)) for name in plan.drafters}

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

    def node_budget(self) -> int:
        """The most tree nodes a request may verify in its next step: its share of ``serve.batching.max_tokens``
        among the requests decoding now, as many as share a forward (``serve.batching.max_requests``); 1 (a
        plain step) when that share is below ``serve.batching.min_tree_nodes``."""
        sharing = max(1, min(self.active, self.cfg.batching.max_requests))
        share = self.cfg.batching.max_tokens // sharing
        return share if share >= self.cfg.batching.min_tree_nodes else 1

    def info(self) -> dict:
        """The target, its context length, the drafters, this replica's pid, Ray node id (``node_id``, hex) and
        resident memory; ``active``:
        decode loops running now (prefill included), ``waiting``: requests accepted but not yet started,
        ``stalled``: decode loops waiting for their reader (:meth:`generate`),
        ``outcomes``: how past requests ended (``finished``, ``refused``, ``failed``, ``cancelled`` /
        ``timeout`` while decoding, ``cancelled_before_prefill`` / ``timeout_before_prefill``), ``batches``:
        target forwards run so far per number of requests they verified; ``cost_model``: :meth:`cost_info`."""
        return {"model": self.target.name, "max_context": self.target.max_context, "drafters": list(self.clients),
                "pid": os.getpid(), "node_id": node_id(), "rss_bytes": rss_bytes(), "active": self.active,
                "waiting": self.waiting, "stalled": self.stalled,
                "outcomes": dict(self.counts), "batches": dict(self.batcher.sizes), "cost_model": self.cost_info()}

    async def generate(self, request: DecodeRequest):
        """The request's events (see the class); the caller reads them as they come. At most
        ``serve.limits.max_buffered_events`` events wait here unread: a decode loop whose reader falls that far
        behind waits before its next event (its slot held, its tokens kept; ``stalled`` in :meth:`info`)
        until the reader takes one, the caller goes away (then it stops as cancelled) or the request's
        deadline passes (then it ends with its 504). The final ``done`` or ``error`` never waits."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        room = threading.BoundedSemaphore(self.cfg.limits.max_buffered_events)
        expires = request.expires_at if request.expires_at is not None else time.time() + self.cfg.limits.request_timeout_s

        def emit(event: dict) -> None:
            if event["type"] not in FINAL_EVENTS and not self._wait_for_room(room, cancel, expires):
                return
            loop.call_soon_threadsafe(queue.put_nowait, event)

        with self._active_lock:
            self.waiting += 1
        done = loop.run_in_executor(self.pool, self.decode, request, emit, cancel, True)
        try:
            while True:
                event = await queue.get()
                if event["type"] in FINAL_EVENTS:
                    yield event
                    break
                room.release()
                yield event
        finally:
            cancel.set()
            await _settle(done)

    def _wait_for_room(self, room: threading.BoundedSemaphore, cancel: threading.Event, expires: float) -> bool:
        """Take a place in a request's event buffer, waiting while it is full; False (no place) once
        ``cancel`` is set or the wall-clock deadline ``expires`` has passed."""
        if room.acquire(blocking=False):
            return True
        with self._active_lock:
            self.stalled += 1
        try:
            while not room.acquire(timeout=ROOM_POLL_S):
                if cancel.is_set() or time.time() > expires:
                    return False
            return True
        finally:
            with self._active_lock:
                self.stalled -= 1

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
        timeout = self.cfg.limits.request_timeout_s
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
        ids, max_tokens, sampling = self._checked(request)
        if stopped := gone():
            return stopped
        emit({"type": "start", "prompt_tokens": len(ids), "max_tokens": max_tokens})
        kept = self.capture is not None and (request.store or self.cfg.capture.mode == "all")
        capture = self.capture if kept and self.capture.sampled() else None
        session = DecodeSession(self.batched, request, emit, self.pieces if request.logprobs is not None else None,
                                capture, self.budget(request.plan), self.cost_info())
        deadline = self.cfg.routing.draft_deadline_s if request.deadline_s is None else request.deadline_s
        strategy = RemoteStrategy(request.rid, request.plan, self.clients, deadline, self.tree.total_tokens,
                                  self.cfg.routing.probe_steps, self.cfg.routing.recheck_every, self.tree,
                                  self._support(request.plan, deadline), self._drafter_layers(request.plan, deadline))
        try:
            stopped = session.run(ids, strategy, sampling, max_tokens, cancel, expires,
                                  self.node_budget if self.cfg.batching.max_tokens else None)
        finally:
            if any("vocabulary" in counts for counts in strategy.skips.values()):
                self._supports.pop(frozenset(request.plan.drafters), None)
        if stopped == "timeout":
            raise RequestError(f"request timed out after {timeout:g} s", None, status=504, type="timeout_error",
                               code="timeout")
        return stopped

    def _checked(self, request: DecodeRequest) -> tuple[list[int], int, SamplingConfig]:
        """The prompt's token ids, the max tokens and the sampling of ``request``; RequestError (400)
        when the prompt or max_tokens do not fit the context, the sampling is invalid, or a drafter of the
        plan is not deployed."""
        ids = self._prompt_ids(request)
        n, limit = len(ids), self.target.max_context
        if n >= limit:
            raise RequestError(f"the prompt has {n} tokens; this model's context length is {limit} tokens, so at "
                               f"most {limit - 1} prompt tokens fit", request.prompt_param,
                               code="context_length_exceeded")
        room = limit - n
        max_tokens = request.max_tokens if request.max_tokens is not None else min(self.cfg.limits.max_tokens_default, room)
        if max_tokens > room:
            raise RequestError(f"max_tokens is {max_tokens}, but the prompt has {n} tokens and this model's context "
                               f"length is {limit}: at most {room} new tokens fit", "max_tokens",
                               code="context_length_exceeded")
        try:
            sampling = check_sampling(request.sampling)
        except ValueError as err:
            raise RequestError(str(err), str(err).split()[0]) from None
        missing = [d for d in request.plan.drafters if d not in self.clients]
        if missing:
            raise RequestError(f"drafter(s) {missing} are not deployed", "taps.drafters", code="drafter_not_found")
        return ids, max_tokens, sampling

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
