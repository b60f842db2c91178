"""The serving metrics without Serve: what one finished request counts, under taps_ and vLLM's names."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from taps_ray.serving.metrics import SERIES, ServingMetrics, ray_name
from taps_ray.spec import stats

USAGE = {"prompt_tokens": 11, "completion_tokens": 9}


def _taps(accept_lengths: list[int], plain: int = 0) -> dict:
    steps = len(accept_lengths) + plain
    return {"strategy": "single", "steps": steps, "accept_lengths": accept_lengths + [0] * plain,
            "drafted_steps": len(accept_lengths), "plain_steps": plain, "draft_tokens": 9 * len(accept_lengths),
            "accepted_tokens": sum(accept_lengths), "route_decisions": {"a": steps}, "skipped": {},
            "tau": stats.acceptance_length(sum(accept_lengths) + steps, steps)}


def _samples(metrics: ServingMetrics) -> dict[str, float]:
    """Sample name (labels summed over) -> value on the replica's page."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_vllm_names_count_what_the_taps_names_count():
    metrics = ServingMetrics("m", "vllm")
    metrics.running.labels("m").inc()
    metrics.waiting.labels("m").inc(2)
    metrics.finished("stop", USAGE, _taps([2, 0, 3, 1]), latency_s=2.0, ttft_s=0.4)
    page = _samples(metrics)
    for series in SERIES.values():
        if series.vllm is None:
            continue
        for suffix in {"counter": ("_total",), "gauge": ("",), "histogram": ("_count", "_sum")}[series.kind]:
            assert page[series.vllm + suffix] == page[series.name + suffix], series.vllm + suffix
    assert page["vllm:spec_decode_num_drafts_total"] == 4 and page["vllm:spec_decode_num_accepted_tokens_total"] == 6
    assert page["vllm:spec_decode_num_draft_tokens_total"] == 36
    assert page["vllm:inter_token_latency_seconds_count"] == 4
    assert page["vllm:inter_token_latency_seconds_sum"] == pytest.approx(1.6)


def test_the_default_names_are_taps_only():
    metrics = ServingMetrics("m")
    metrics.finished("stop", USAGE, _taps([1]), latency_s=1.0, ttft_s=0.5)
    page = _samples(metrics)
    assert page["taps_spec_decode_num_drafts_total"] == 1 and not [n for n in page if n.startswith("vllm")]


def test_per_position_counts_and_mean_acceptance_length_is_tau():
    metrics = ServingMetrics("m", "vllm")
    lengths = [[2, 0, 3, 1], [4, 4, 0]]
    for accept_lengths in lengths:
        metrics.finished("length", USAGE, _taps(accept_lengths), latency_s=1.0, ttft_s=0.2)
    per_pos = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = {int(s.labels["position"]): s.value for s in family.samples if s.name.endswith("_total")}
    flat = [a for request in lengths for a in request]
    assert per_pos == {p: sum(a > p for a in flat) for p in range(4)}
    page = _samples(metrics)
    mean_length = 1 + page["vllm:spec_decode_num_accepted_tokens_total"] / page["vllm:spec_decode_num_drafts_total"]
    assert mean_length == pytest.approx(stats.acceptance_length(sum(a + 1 for a in flat), len(flat)))


def test_gauges_go_back_to_zero():
    metrics = ServingMetrics("m", "vllm")
    running = metrics.running.labels("m")
    running.inc()
    running.inc()
    running.dec()
    assert _samples(metrics)["vllm:num_requests_running"] == 1
    running.dec()
    assert _samples(metrics)["vllm:num_requests_running"] == 0
    assert metrics.running.values == {("m",): 0.0}


def test_names_through_ray_have_no_colon():
    metrics = ServingMetrics("m", "vllm")
    assert [r._name for r in metrics.drafts.rays] == ["taps_spec_decode_num_drafts", "vllm_spec_decode_num_drafts"]
    assert ray_name("vllm:inter_token_latency_seconds") == "vllm_inter_token_latency_seconds"


def test_drafter_versions_count_replicas_per_version_and_a_version_no_replica_serves_drops_to_zero():
    metrics = ServingMetrics("m")

    def versions() -> dict[tuple[str, str], float]:
        family = next(f for f in text_string_to_metric_families(metrics.render().decode())
                      if f.name == "taps_drafter_version")
        return {(s.labels["drafter"], s.labels["version"]): s.value for s in family.samples}

    metrics.serving_versions({"math": {0: 2}, "chat": {0: 1}})
    assert versions() == {("math", "0"): 2, ("chat", "0"): 1}
    metrics.serving_versions({"math": {0: 1, 3: 1}, "chat": {0: 1}})  # a promotion half way through its replicas
    assert versions() == {("math", "0"): 1, ("math", "3"): 1, ("chat", "0"): 1}
    metrics.serving_versions({"math": {3: 2}, "chat": {}})  # chat's replicas did not answer
    assert versions() == {("math", "0"): 0, ("math", "3"): 2, ("chat", "0"): 0}


def test_the_verifiers_cost_model_is_a_gauge_per_node_count():
    metrics = ServingMetrics("m")
    cost = {"plain_step_ms": 40.0, "relative": {1: 1.0, 16: 1.7, 64: 4.2}, "hardware": "cpu", "dtype": "float32",
            "threads": 2, "engine": "static-packed"}
    metrics.finished("stop", USAGE, {**_taps([1]), "cost_model": cost}, latency_s=1.0, ttft_s=0.5)
    values = {(s.name, s.labels.get("nodes")): s.value
              for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    assert values[("taps_plain_step_seconds", None)] == pytest.approx(0.04)
    assert values[("taps_verify_cost_relative", "16")] == pytest.approx(1.7)
    assert values[("taps_verify_cost_relative", "64")] == pytest.approx(4.2) and metrics.cost_model == cost
