"""One request's decode session: the decode loop's run, its text and logprob stream, and the events
it sends.

A :class:`DecodeSession` is the loop's step observer (:class:`~taps_ray.spec.stream.StepObserver`): it
turns the tokens and text the loop commits into ``delta`` events (with the logprobs of the tokens that
text consumed, :mod:`taps_ray.serving.logprobs`), and ends with the ``done`` event (finish reason, usage,
the ``taps`` block of :func:`summarize`) from the loop's result. Stop sequences, cancellation, deadlines and
the node limit are the loop's. With a capture writer (:mod:`taps_ray.data.capture`), the finished
request is then handed to it with the features the loop computed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from taps_ray.config import SamplingConfig
from taps_ray.data.capture import CaptureWriter, request_prompt_hash, step_labels
from taps_ray.models.target import TargetModel
from taps_ray.serving.drafting import RemoteStrategy
from taps_ray.serving.logprobs import LogprobStream, TokenPieces
from taps_ray.serving.plan import DecodeRequest, Plan
from taps_ray.spec import stats
from taps_ray.spec.cost import TreeBudget
from taps_ray.spec.decoder import GenerationResult, generate
from taps_ray.spec.stats import StepRecord

log = logging.getLogger(__name__)


def summarize(plan: Plan, records: list[StepRecord], skips: dict, prefill_s: float | None, total_s: float) -> dict:
    """The response's ``taps`` block (and what the metrics count) from the loop's step ``records``: the
    accepted and appended counts (the loop cut the last step's at a stop sequence), the time spent waiting
    for drafts (``draft_s``: calls, transfer and drafting; ``drafter_compute_s`` of it was the drafters'
    own work, from the strategy's step notes) and verifying (``verify_s``), the node limit's cuts, the
    routes taken and ``adapted`` (a ``taps adapt`` version of a drafter drafted a step); ``skips``: the strategy's skip counts per drafter and reason."""
    accepted, appended = [r.accepted for r in records], [r.appended for r in records]
    sizes = [r.tree_size for r in records]
    tau = stats.acceptance_length(sum(appended), len(appended))
    routes = [r.meta.get("route") for r in records]
    out = {
        "strategy": plan.name, "drafters": list(plan.drafters), "steps": len(sizes),
        "tau": None if math.isnan(tau) else tau,
        "accept_lengths": accepted,
        "draft_tokens": sum(n - 1 for n in sizes),
        "accepted_tokens": sum(accepted),
        "drafted_steps": sum(n > 1 for n in sizes),
        "plain_steps": sum(n <= 1 for n in sizes),
        "shrunk_steps": sum(r.shed > 0 or r.load_plain for r in records),
        "shed_draft_tokens": sum(r.shed for r in records),
        "route_decisions": dict(Counter(route for route in routes if route is not None)),
        "skipped": skips,
        "prefill_s": None if prefill_s is None else round(prefill_s, 4), "total_s": round(total_s, 4),
        "drafter_compute_s": round(sum(r.meta.get("compute_s", 0.0) for r in records), 4),
        "draft_s": round(sum(r.draft_s for r in records), 4),
        "verify_s": round(sum(r.verify_s for r in records), 4),
        "adapted": any(r.meta.get("adapted", False) for r in records),
    }
    if plan.kind == "routed":
        out["route_per_step"] = routes
    return out


class DecodeSession:
    """The events of one request (``emit`` receives them): ``delta`` texts while the loop runs (as its step
    observer), then ``done``. ``capture``: where the finished request goes (None: nowhere); ``budget``: the
    tree budget its steps are sized by (None: every tree verified whole), and ``cost``: the cost model it
    uses, as the ``taps`` block reports it."""

    def __init__(self, target: TargetModel, request: DecodeRequest, emit: Callable[[dict], None],
                 pieces: TokenPieces | None, capture: CaptureWriter | None = None, budget: TreeBudget | None = None,
                 cost: dict | None = None):
        self.target, self.request, self.emit, self.capture = target, request, emit, capture
        self.budget, self.cost = budget, cost
        self.logprobs = LogprobStream(pieces, request.logprobs) if request.logprobs is not None else None
        self.pending: list[int] = []
        self.sent = 0
        self.result: GenerationResult | None = None

    def with_logprobs(self, event: dict) -> dict:
        """``event`` with the logprobs of the tokens consumed since the last event."""
        if self.logprobs is not None:
            event["logprobs"] = self.logprobs.take(self.pending)
        self.pending = []
        return event

    def on_step(self, tokens: list[int], text: str) -> None:
        self.pending += tokens
        if text:
            self.sent += len(text)
            self.emit(self.with_logprobs({"type": "delta", "text": text}))

    def run(self, ids: list[int], strategy: RemoteStrategy, sampling: SamplingConfig, max_tokens: int,
            cancel: threading.Event | None = None, deadline: float | None = None,
            node_limit: Callable[[], int] | None = None) -> str | None:
        """Decode ``ids`` with ``strategy`` and send ``done``; the reason (``cancelled`` / ``timeout``) when the
        loop was stopped before its end by ``cancel`` or ``deadline`` (monotonic; then nothing is sent).
        Frees the drafting sessions."""
        start = time.perf_counter()
        sink = [] if self.capture is not None and self.capture.cfg.features else None
        try:
            self.result = generate(self.target, torch.tensor(ids), strategy, sampling, max_tokens,
                                   logprobs=self.request.logprobs,
                                   on_logprobs=self.logprobs.add if self.logprobs is not None else None,
                                   feature_sink=sink, budget=self.budget, stop=self.request.stop or None,
                                   observer=self, cancel=cancel, deadline=deadline, node_limit=node_limit)
        finally:
            strategy.close()
        if self.result.finish_reason in ("cancelled", "timeout"):
            return self.result.finish_reason
        finish, taps = self._done(len(ids), strategy, time.perf_counter() - start)
        if self.capture is not None:
            self._capture(ids, sink, finish, taps)
        return None

    def _capture(self, ids: list[int], sink: list[torch.Tensor] | None, finish: str, taps: dict) -> None:
        """Hand the finished request to the capture writer (a failure is logged, never sent)."""
        labels = {"drafters": taps["drafters"], "steps": step_labels(self.result.steps),
                  "route_decisions": taps["route_decisions"], "tau": taps["tau"]}
        try:
            features = torch.cat(sink) if sink else None
            self.capture.add(ids, self.result.token_ids, features,
                             request_prompt_hash(self.request.prompt, self.target.tokenizer), taps["strategy"],
                             finish, labels)
        except Exception:
            log.exception("request %s: capturing it failed", self.request.rid)

    def _done(self, prompt_tokens: int, strategy: RemoteStrategy, total_s: float) -> tuple[str, dict]:
        """Send ``done``; its finish reason and ``taps`` block."""
        result = self.result
        text = result.text or ""
        finish = "stop" if result.finish_reason in ("stop", "eos") else "length"
        completion = len(result.token_ids)
        taps = summarize(self.request.plan, result.steps, strategy.skip_counts, result.prefill_s, total_s)
        if self.cost is not None:
            taps["cost_model"] = self.cost
        self.emit(self.with_logprobs({
            "type": "done", "delta": text[self.sent:], "text": text, "finish_reason": finish,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}, "taps": taps}))
        return finish, taps
