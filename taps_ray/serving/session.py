"""One request's decode session: its text and logprob stream, the decode loop's run, and the
events it sends.

A :class:`DecodeSession` turns the tokens the loop commits into ``delta`` events (text that is safe to
send: :class:`TextStream` holds back a possible stop sequence and an incomplete character; with the
logprobs of the tokens that text consumed, :mod:`taps_ray.serving.logprobs`), stops the loop at a stop
sequence, and ends with the ``done`` event (finish reason, usage, the ``taps`` block of
:func:`summarize`). With a capture writer (:mod:`taps_ray.serving.capture`), the finished request is
then handed to it with the features the loop computed.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable

import torch

from taps_ray.config import SamplingConfig
from taps_ray.models.target import TargetModel
from taps_ray.serving.capture import CaptureWriter, request_prompt_hash, step_labels
from taps_ray.serving.drafting import RemoteStrategy, StepInfo, StopGeneration
from taps_ray.serving.logprobs import LogprobStream, TokenPieces
from taps_ray.serving.plan import DecodeRequest, Plan
from taps_ray.spec import stats
from taps_ray.spec.cost import TreeBudget
from taps_ray.spec.decoder import GenerationResult, generate
from taps_ray.spec.stats import StepRecord

log = logging.getLogger(__name__)

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
        sizes = [r.tree_size for r in records]
    else:
        accepted = [s.accepted or 0 for s in steps]
        appended = [s.appended or 0 for s in steps]
        sizes = [s.tree_size for s in steps]
    if completion_tokens is not None:
        appended = stats.stop_trimmed(appended, max(completion_tokens - 1, 0))
    tau = stats.acceptance_length(sum(appended), len(appended))
    routes = [s.route for s in steps if s.route is not None]
    out = {
        "strategy": plan.name, "drafters": list(plan.drafters), "steps": len(sizes),
        "tau": None if math.isnan(tau) else tau,
        "accept_lengths": accepted,
        "draft_tokens": sum(n - 1 for n in sizes),
        "accepted_tokens": sum(accepted),
        "drafted_steps": sum(n > 1 for n in sizes),
        "plain_steps": sum(n <= 1 for n in sizes),
        "shrunk_steps": sum(s.shed > 0 or s.load_plain for s in steps),
        "shed_draft_tokens": sum(s.shed for s in steps),
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



class DecodeSession:
    """The events of one request (``emit`` receives them): ``delta`` texts while the loop runs, then
    ``done``. Build it, hand :meth:`on_tokens` to the :class:`RemoteStrategy` as its ``on_tokens``,
    then :meth:`run` the loop. ``capture``: where the finished request goes (None: nowhere); ``budget``: the
    tree budget its steps are sized by (None: every tree verified whole), and ``cost``: the cost model it
    uses, as the ``taps`` block reports it."""

    def __init__(self, target: TargetModel, request: DecodeRequest, emit: Callable[[dict], None],
                 pieces: TokenPieces | None, capture: CaptureWriter | None = None, budget: TreeBudget | None = None,
                 cost: dict | None = None):
        self.target, self.request, self.emit, self.capture = target, request, emit, capture
        self.budget, self.cost = budget, cost
        self.text = TextStream(target.tokenizer, request.stop)
        self.logprobs = LogprobStream(pieces, request.logprobs) if request.logprobs is not None else None
        self.given = 0
        self.result: GenerationResult | None = None

    def with_logprobs(self, event: dict) -> dict:
        """``event`` with the logprobs of the tokens the text consumed since the last event."""
        if self.logprobs is not None:
            event["logprobs"] = self.logprobs.take(self.text.ids[self.given:self.text.used])
            self.given = self.text.used
        return event

    def on_tokens(self, tokens: list[int]) -> None:
        delta = self.text.push(tokens)
        if delta:
            self.emit(self.with_logprobs({"type": "delta", "text": delta}))
        if self.text.hit:
            raise StopGeneration("stop")

    def run(self, ids: list[int], strategy: RemoteStrategy, sampling: SamplingConfig, max_tokens: int) -> str | None:
        """Decode ``ids`` with ``strategy`` and send ``done``; the reason (``cancelled`` / ``timeout``)
        when the loop was stopped before its end (then nothing is sent). Frees the drafting sessions."""
        start = time.perf_counter()
        sink = [] if self.capture is not None and self.capture.cfg.features else None
        try:
            self.result = generate(self.target, torch.tensor(ids), strategy, sampling, max_tokens,
                                   logprobs=self.request.logprobs,
                                   on_logprobs=self.logprobs.add if self.logprobs is not None else None,
                                   feature_sink=sink, budget=self.budget)
        except StopGeneration as stop:
            if stop.reason != "stop":
                return stop.reason
        finally:
            strategy.close()
        finish, taps = self._done(len(ids), strategy, time.perf_counter() - start)
        if self.capture is not None:
            self._capture(ids, sink, strategy, finish, taps)
        return None

    def _capture(self, ids: list[int], sink: list[torch.Tensor] | None, strategy: RemoteStrategy, finish: str,
                 taps: dict) -> None:
        """Hand the finished request to the capture writer (a failure is logged, never sent)."""
        records = self.result.steps if self.result is not None else None
        labels = {"drafters": taps["drafters"], "steps": step_labels(strategy.steps, records),
                  "route_decisions": taps["route_decisions"], "tau": taps["tau"]}
        try:
            features = torch.cat(sink) if sink else None
            self.capture.add(ids, self.text.ids[:self.text.used], features,
                             request_prompt_hash(self.request.prompt, self.target.tokenizer), taps["strategy"],
                             finish, labels)
        except Exception:
            log.exception("request %s: capturing it failed", self.request.rid)

    def _done(self, prompt_tokens: int, strategy: RemoteStrategy, total_s: float) -> tuple[str, dict]:
        """Send ``done``; its finish reason and ``taps`` block."""
        text, result = self.text, self.result
        if result is not None:
            delta = text.push(result.token_ids[text.used:])
            finish = "stop" if text.hit or result.finish_reason == "eos" else "length"
            prefill_s, records = result.prefill_s, result.steps
        else:
            delta, finish, prefill_s, records = "", "stop", None, None
        delta += text.flush()
        completion = text.used
        taps = summarize(self.request.plan, strategy.steps, strategy.skip_counts, prefill_s, total_s, records,
                         completion)
        if self.cost is not None:
            taps["cost_model"] = self.cost
        self.emit(self.with_logprobs({
            "type": "done", "delta": delta, "text": text.text, "finish_reason": finish,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}, "taps": taps}))
        return finish, taps
