"""Serving metrics as a dashboard reads them: Ray's Prometheus export of the cluster (the node's
``MetricsExportPort``, what Prometheus scrapes and Grafana queries), with two ingress replicas
recording into the same series under the taps_ and vLLM's names."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import requests
from prometheus_client.parser import text_string_to_metric_families

from taps_ray.config import load_config
from taps_ray.spec import stats
from tests.serving.helpers import served_app

pytestmark = pytest.mark.integration

APP = "taps-metrics"
MODEL = "smollm2-135m"
PROMPTS = ["What is 7 times 8?", "Name three colours of the rainbow.", "Write one sentence about the sea.",
           "Give me a synonym for quick.", "What is the capital of France?", "Count from one to five."]
Snapshot = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def server(ray_session):
    cfg = load_config(None, [
        f"tree={json.dumps({'depth': 2, 'top_k': 4, 'total_tokens': 10, 'adaptive': False})}", "target.threads=1",
        "target.dtype=float32", "serve.drafters={a: {seed: 0}}", "serve.routing.draft_deadline_s=30",
        "serve.limits.request_timeout_s=300", "serve.ingress.num_replicas=2", "serve.http.metrics_names=vllm",
    ])
    with served_app(cfg, APP, lambda: None) as (url, _):
        yield url


def _export_url() -> str:
    node = next(n for n in ray.nodes() if n["Alive"])
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def _scrape() -> Snapshot:
    """This application's ingress series in Ray's export: (sample name, labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(requests.get(_export_url(), timeout=30).text):
        for s in family.samples:
            if (s.name.startswith(("ray_taps_", "ray_vllm_")) and s.labels.get("application") == APP
                    and s.labels.get("deployment") == "Ingress"):
                out[s.name, frozenset(s.labels.items())] = s.value
    return out


def _total(snapshot: Snapshot, name: str) -> float:
    return sum(v for (n, _), v in snapshot.items() if n == name)


def _replicas(snapshot: Snapshot) -> set[str]:
    return {dict(labels)["replica"] for (n, labels) in snapshot if n == "ray_taps_request_success_total"}


def _exported(finished: int) -> Snapshot:
    """Ray's export once it counts ``finished`` successful requests (it reports every few seconds)."""
    deadline = time.time() + 120
    while True:
        snapshot = _scrape()
        if _total(snapshot, "ray_taps_request_success_total") >= finished or time.time() > deadline:
            return snapshot
        time.sleep(2)


def _chat(server: str, prompt: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0}
    response = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_ingress_replicas_export_one_monotonic_series_whose_mean_acceptance_length_is_tau(server):
    replies, snapshots = [], [_scrape()]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        for _ in range(8):  # until both replicas have answered (the proxy picks one per request)
            replies += pool.map(lambda p: _chat(server, p), PROMPTS)
            snapshots.append(_exported(len(replies)))
            if len(snapshots) > 2 and len(_replicas(snapshots[-1])) == 2:
                break
    last = snapshots[-1]
    assert len(_replicas(last)) == 2, "both ingress replicas record into the exported series"
    for before, after in zip(snapshots, snapshots[1:]):  # every series of every replica only grows
        for key, value in before.items():
            if key[0].endswith(("_total", "_count", "_bucket")):
                assert after.get(key, -1) >= value, key

    taps = [r["taps"] for r in replies]
    assert all(t["plain_steps"] == 0 for t in taps)  # the deadline is long: every step drafted
    expected = {"spec_decode_num_drafts_total": sum(t["drafted_steps"] for t in taps),
                "spec_decode_num_draft_tokens_total": sum(t["draft_tokens"] for t in taps),
                "spec_decode_num_accepted_tokens_total": sum(t["accepted_tokens"] for t in taps),
                "spec_decode_num_accepted_tokens_per_pos_total": sum(t["accepted_tokens"] for t in taps),
                "generation_tokens_total": sum(r["usage"]["completion_tokens"] for r in replies),
                "request_success_total": len(replies),
                "inter_token_latency_seconds_count": sum(t["steps"] for t in taps)}
    for name, value in expected.items():
        for prefix in ("ray_taps_", "ray_vllm_"):
            assert _total(last, prefix + name) == value, prefix + name

    accept_lengths = [a for t in taps for a in t["accept_lengths"]]
    tau = stats.acceptance_length(sum(a + 1 for a in accept_lengths), len(accept_lengths))  # before trimming
    mean_length = 1 + (_total(last, "ray_vllm_spec_decode_num_accepted_tokens_total")
                       / _total(last, "ray_vllm_spec_decode_num_drafts_total"))
    assert mean_length == pytest.approx(tau)
    served = stats.acceptance_length(sum(round(t["tau"] * t["steps"]) for t in taps), sum(t["steps"] for t in taps))
    assert served <= mean_length + 1e-9  # the served tau counts tokens after trimming at max_tokens or EOS
