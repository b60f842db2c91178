"""Pure helpers of the serving soak (benchmarks/load_test.py, benchmarks/bench_serving.py): request
outcomes, Retry-After, the memory groups of a Ray session's processes and the flatness figures."""

from __future__ import annotations

import importlib
import itertools

import openai
import pytest

from benchmarks.bench_serving import flatness, process_group, slope_per_min
from benchmarks.load_test import hangup_plan, outcome_of, retry_after_s

try:  # the HTTP library of the installed openai client (httpx2 in recent releases)
    http = importlib.import_module("httpx2")
except ImportError:
    http = importlib.import_module("httpx")


def _status_error(status: int, headers: dict | None = None) -> openai.APIStatusError:
    request = http.Request("POST", "http://test/v1/chat/completions")
    response = http.Response(status, headers=headers or {}, request=request)
    kind = {429: openai.RateLimitError, 500: openai.InternalServerError, 503: openai.InternalServerError}[status]
    return kind("refused", response=response, body=None)


def test_outcomes_of_attempts():
    assert outcome_of(None) == "completed"
    assert outcome_of(None, hung_up=True) == "hung_up"
    assert outcome_of(_status_error(429, {"Retry-After": "2"})) == "rejected_429"
    assert outcome_of(_status_error(500)) == "error"
    assert outcome_of(_status_error(503, {"Retry-After": "1"})) == "error"
    assert outcome_of(openai.APIConnectionError(request=http.Request("POST", "http://test"))) == "error"
    assert outcome_of(RuntimeError("stream broke")) == "error"


def test_retry_after_is_read_from_the_429():
    assert retry_after_s(_status_error(429, {"Retry-After": "2"})) == 2.0
    assert retry_after_s(_status_error(429, {"Retry-After": "0.5"})) == 0.5
    assert retry_after_s(_status_error(429)) == 1.0
    assert retry_after_s(_status_error(429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}), default=3.0) == 3.0
    assert retry_after_s(RuntimeError("no response")) == 1.0


@pytest.mark.parametrize(("cmdline", "group"), [
    (["ray::ServeReplica:taps:Verifier"], "Verifier"),
    (["ray::ServeReplica:taps:Verifier.generate"], "Verifier"),
    (["ray::ServeReplica:taps:Drafter_math.propose"], "Drafter_math"),
    (["ray::ServeReplica:taps:Ingress"], "Ingress"),
    (["ray::SERVE_REPLICA::taps#Drafter_math#09oc1fgd:ServeReplica:taps:Drafter_math"], "Drafter_math"),
    (["ray::ServeController"], "serve_controller"),
    (["ray::ProxyActor"], "proxy"),
    (["ray::IDLE"], "idle_workers"),
    (["ray::IDLE_SpillWorker"], "idle_workers"),
    (["ray::DashboardAgent"], "DashboardAgent"),
    (["/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/x"], "gcs"),
    (["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=s"], "raylet"),
    (["/venv/bin/python", "-u", "/venv/lib/python3.11/site-packages/ray/_private/log_monitor.py"], "log_monitor"),
    (["/venv/bin/python", "-u", "/venv/lib/ray/autoscaler/_private/monitor.py", "--logs-dir=x"],
     "autoscaler_monitor"),
    (["/usr/bin/sleep", "5"], "other:sleep"),
    ([], "other"),
])
def test_process_groups(cmdline, group):
    assert process_group(cmdline) == group


def test_the_benchmark_process_is_its_own_group():
    assert process_group(["/venv/bin/python", "benchmarks/bench_serving.py"], is_self=True) == "benchmark"


def test_slope_in_mib_per_minute():
    assert slope_per_min([(0, 100.0), (30, 110.0), (60, 120.0)]) == pytest.approx(20.0)
    assert slope_per_min([(0, 100.0), (60, 100.0), (120, 100.0)]) == 0.0
    assert slope_per_min([(0, 100.0)]) is None
    assert slope_per_min([(5, 100.0), (5, 120.0)]) is None


def test_flatness_of_a_group_warming_up_then_flat():
    """A replica that grows for the first half and then stays put: the second half's slope is 0; a
    group missing from a sample (a replica being replaced) counts 0 there."""
    samples = [{"t": t, "mib": {"Verifier": min(1000.0 + t, 1060.0), "Drafter_math": 500.0}} for t in range(0, 181, 10)]
    samples[3]["mib"].pop("Drafter_math")
    verifier = flatness(samples, "Verifier")
    assert verifier["start"] == 1000.0 and verifier["end"] == 1060.0 and verifier["max"] == 1060.0
    assert verifier["slope_mib_per_min"] > 0 and verifier["second_half_slope_mib_per_min"] == 0.0
    drafter = flatness(samples, "Drafter_math")
    assert drafter["start"] == 500.0 and drafter["end"] == 500.0 and drafter["max"] == 500.0


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.25, 1 / 3, 1.0])
def test_hangup_plan_keeps_the_share_and_follows_its_seed(fraction):
    plan = list(itertools.islice(hangup_plan(fraction, seed=0), 200))
    for n in range(10, 201, 10):
        assert sum(plan[:n]) == round(fraction * n)
    assert list(itertools.islice(hangup_plan(fraction, seed=0), 200)) == plan
    if 0 < fraction < 1:
        assert list(itertools.islice(hangup_plan(fraction, seed=1), 200)) != plan
