"""Prometheus metrics of the ingress, vLLM-like names prefixed ``taps_``.

Counted from each finished request's ``taps`` block (see :func:`taps_ray.serving.verifier.summarize`):
a draft is one verified tree, draft tokens are its nodes besides the root, accepted tokens per
position count steps whose accepted length reached that position (0-based, as vLLM counts).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
disable_created_metrics()

TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class ServingMetrics:
    """The serving counters and histograms in their own registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str):
        self.model = model
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]
        self.success = Counter("taps_request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=registry)
        self.failure = Counter("taps_request_failure", "Requests answered with an error, by HTTP status",
                               labels + ["status"], registry=registry)
        self.running = Gauge("taps_num_requests_running", "Requests being decoded", labels, registry=registry)
        self.waiting = Gauge("taps_num_requests_waiting", "Requests waiting for a verifier slot", labels,
                             registry=registry)
        self.aborted = Counter("taps_request_aborted", "Requests given up before they finished, by reason "
                               "(disconnect: the client hung up; timeout: serve.request_timeout_s ran out in the queue)",
                               labels + ["reason"], registry=registry)
        self.prompt_tokens = Counter("taps_prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=registry)
        self.generation_tokens = Counter("taps_generation_tokens", "Generated tokens of finished requests", labels,
                                         registry=registry)
        self.steps = Counter("taps_spec_decode_num_steps", "Target verification steps (drafted or plain)", labels,
                             registry=registry)
        self.drafts = Counter("taps_spec_decode_num_drafts", "Verified draft trees", labels, registry=registry)
        self.draft_tokens = Counter("taps_spec_decode_num_draft_tokens", "Verified draft tree nodes (root excluded)",
                                    labels, registry=registry)
        self.accepted_tokens = Counter("taps_spec_decode_num_accepted_tokens", "Accepted draft tokens", labels,
                                       registry=registry)
        self.accepted_per_pos = Counter("taps_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the accepted path (0-based)",
                                        labels + ["position"], registry=registry)
        self.plain_steps = Counter("taps_spec_decode_num_plain_steps", "Steps decoded without a draft tree",
                                   labels, registry=registry)
        self.route_decisions = Counter("taps_spec_decode_route_decisions", "Routing decisions by chosen drafter",
                                       labels + ["drafter"], registry=registry)
        self.drafter_skips = Counter("taps_drafter_skipped_steps", "Steps a drafter was skipped in, by reason",
                                     labels + ["drafter", "reason"], registry=registry)
        self.strategy_requests = Counter("taps_strategy_requests", "Finished requests by strategy",
                                         labels + ["strategy"], registry=registry)
        self.tau = Histogram("taps_acceptance_length", "Per-request tau (tokens appended per step)", labels,
                             buckets=TAU_BUCKETS, registry=registry)
        self.e2e = Histogram("taps_e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("taps_time_to_first_token_seconds", "Time to the first generated text", labels,
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("taps_time_per_output_token_seconds", "Decode time per generated token", labels,
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28), registry=registry)

    def finished(self, finish: str, usage: dict, taps: dict, latency_s: float, ttft_s: float | None) -> None:
        m = self.model
        self.success.labels(m, finish).inc()
        self.prompt_tokens.labels(m).inc(usage["prompt_tokens"])
        self.generation_tokens.labels(m).inc(usage["completion_tokens"])
        self.strategy_requests.labels(m, taps["strategy"]).inc()
        self.steps.labels(m).inc(taps["steps"])
        self.drafts.labels(m).inc(taps["drafted_steps"])
        self.draft_tokens.labels(m).inc(taps["draft_tokens"])
        self.accepted_tokens.labels(m).inc(taps["accepted_tokens"])
        self.plain_steps.labels(m).inc(taps["plain_steps"])
        for accepted in taps["accept_lengths"]:
            for position in range(accepted):
                self.accepted_per_pos.labels(m, str(position)).inc()
        for drafter, count in taps["route_decisions"].items():
            self.route_decisions.labels(m, drafter).inc(count)
        for drafter, reasons in taps["skipped"].items():
            for reason, count in reasons.items():
                self.drafter_skips.labels(m, drafter, reason).inc(count)
        if taps["tau"] is not None:
            self.tau.labels(m).observe(taps["tau"])
        self.e2e.labels(m).observe(latency_s)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
            if usage["completion_tokens"] > 1:
                self.tpot.labels(m).observe((latency_s - ttft_s) / (usage["completion_tokens"] - 1))

    def failed(self, status: int) -> None:
        self.failure.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


_current: ServingMetrics | None = None


def register(metrics: ServingMetrics) -> ServingMetrics:
    """Make ``metrics`` this process's serving metrics (what error handlers outside a replica count into)."""
    global _current
    _current = metrics
    return metrics


def current() -> ServingMetrics | None:
    return _current
