"""Load shedding, readiness and cancellation on the real Serve application (embedded target), sized
small: 2 decoding slots and a queue of 18 per ingress. A burst beyond slots + queue is answered 429
at once while /health and /ready stay up; clients that hang up, mid-stream or while queued, leave no
decoding behind in the verifier; afterwards a normal request is answered exactly."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from ray import serve

from taps_ray.config import load_config
from taps_ray.spec.decoder import generate
from tests.serving.helpers import metric, served_app

pytestmark = pytest.mark.integration

APP = "taps-load"
MODEL = "smollm2-135m"
SLOTS, QUEUE = 2, 18
PROMPT = "Count from one to five."
NEW = 12
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def served(ray_session, embedded_target):
    """The application on a free port, and the in-process greedy reference for :data:`PROMPT`."""
    cfg = load_config(None, [
        'tree={"depth": 2, "top_k": 3, "total_tokens": 8}', "target.threads=1", "target.dtype=float32",
        "serve.drafters={a: {seed: 0}}", "serve.routing.draft_deadline_s=30", "serve.limits.request_timeout_s=120",
        f"serve.admission.max_concurrent_requests={SLOTS}", f"serve.admission.max_queued_requests={QUEUE}", "serve.admission.retry_after_s=2",
    ])
    with served_app(cfg, APP, lambda: generate(embedded_target, [{"role": "user", "content": PROMPT}],
                                               max_new_tokens=NEW).text) as served:
        yield served


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


def _verifier() -> dict:
    return serve.get_deployment_handle("Verifier", APP).info.remote().result(timeout_s=30)


def _counting(max_tokens: int = 400, stream: bool = True) -> dict:
    """A completion that keeps counting (no early EOS) for ``max_tokens``: it holds its slot until closed."""
    return {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


def _no_decoding_left(within_s: float) -> dict:
    """Poll the verifier until no decode loop runs and none waits; fail after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        info = _verifier()
        if info["active"] == 0 and info["waiting"] == 0:
            return info
        assert time.monotonic() < deadline, f"decoding left behind: {info}"
        time.sleep(0.1)


def _answers_exactly(server: str, reference: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": NEW, "temperature": 0}
    response = requests.post(server + CHAT, json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == reference


def test_health_and_readiness(server):
    assert requests.get(f"{server}/health", timeout=30).json() == {"status": "ok"}
    ready = requests.get(f"{server}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "verifier": "up",
                                                         "drafters": {"a": "up"}}


def test_a_burst_beyond_the_queue_is_shed_at_once_and_probes_stay_up(server, served):
    """SLOTS + QUEUE + EXTRA streams at once: the EXTRA beyond the slots and the queue get a 429 with
    Retry-After at once (the ingress's admission is exact; Serve's looser bound behind it may refuse
    a few more, never fewer); the ones decoding hold their slots until the refusals are in, then
    hang up after the first chunk."""
    extra = 12
    n = SLOTS + QUEUE + extra
    shed = 'taps_request_failure_total{model_name="smollm2-135m",status="429"}'
    before = metric(requests.get(f"{server}/metrics", timeout=30).text, shed)
    results: list[tuple[int, requests.structures.CaseInsensitiveDict, bytes]] = []
    lock, enough = threading.Lock(), threading.Event()
    probes: dict[str, requests.Response] = {}

    def client() -> None:
        with requests.post(server + COMPLETIONS, json=_counting(), stream=True, timeout=120) as response:
            lines = response.iter_lines()  # kept: dropping a half-read iterator closes the connection
            first = next(lines) if response.status_code == 200 else response.content
            with lock:
                results.append((response.status_code, response.headers, first))
                if len(results) >= SLOTS + extra:
                    enough.set()
            if response.status_code == 200:
                enough.wait(60)

    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    assert enough.wait(120), f"only {len(results)} of {n} answered while the slots were held"
    probes["health"] = requests.get(f"{server}/health", timeout=10)
    probes["ready"] = requests.get(f"{server}/ready", timeout=10)
    for t in threads:
        t.join(120)
    statuses = sorted(status for status, _, _ in results)
    assert len(results) == n and set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= extra and statuses.count(200) >= SLOTS, statuses
    for status, headers, body in results:
        if status == 429:
            error = json.loads(body)["error"]
            assert error["code"] == "server_busy" and error["type"] == "rate_limit_error" and error["request_id"]
            assert headers["Retry-After"] == "2" and headers["X-Request-ID"] == error["request_id"]
        else:
            assert body.startswith(b"data: ") and json.loads(body[6:])["choices"][0]["text"]
    assert probes["health"].status_code == 200 and probes["health"].json() == {"status": "ok"}
    assert probes["ready"].status_code == 200 and probes["ready"].json()["status"] == "ready"
    page = requests.get(f"{server}/metrics", timeout=30).text
    assert metric(page, shed) - before == statuses.count(429)
    _no_decoding_left(30)
    _answers_exactly(server, served[1])


def test_a_storm_of_hangups_leaves_no_decoding_behind(server, served):
    """20 streams that hang up after their first chunk: within 2 s of the last hangup no decode loop
    runs or waits in the verifier, every loop that started ended as cancelled, and the next request
    is answered exactly."""
    before = _no_decoding_left(30)["outcomes"]
    statuses: list[int] = []

    def hang_up() -> None:
        with requests.post(server + COMPLETIONS, json=_counting(), stream=True, timeout=120) as response:
            statuses.append(response.status_code)
            if response.status_code == 200:
                next(response.iter_lines())
            response.close()

    threads = [threading.Thread(target=hang_up) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    info = _no_decoding_left(2.0)
    assert len(statuses) == 20 and set(statuses) <= {200, 429} and statuses.count(200) >= SLOTS + QUEUE - 2
    new = {k: v - before.get(k, 0) for k, v in info["outcomes"].items() if v != before.get(k, 0)}
    assert set(new) <= {"cancelled", "cancelled_before_prefill"}, new
    assert sum(new.values()) == statuses.count(200), (new, statuses)
    _answers_exactly(server, served[1])


def test_clients_that_hang_up_while_queued_never_reach_the_verifier(server, served):
    """Two streams hold both slots; five more wait in the queue and give up (a 1 s read timeout): they
    leave the queue, so once the two are closed the verifier has seen exactly two more requests."""
    before = sum(_no_decoding_left(30)["outcomes"].values())
    hold, held = threading.Event(), []

    def holder() -> None:
        with requests.post(server + COMPLETIONS, json=_counting(2000), stream=True, timeout=120) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: dropping a half-read iterator closes the connection
            held.append(next(lines))
            hold.wait(120)

    holders = [threading.Thread(target=holder) for _ in range(SLOTS)]
    for t in holders:
        t.start()
    deadline = time.monotonic() + 60
    while len(held) < SLOTS:
        assert time.monotonic() < deadline, "the holders did not start"
        time.sleep(0.05)
    gave_up = 0
    for _ in range(5):
        try:
            requests.post(server + COMPLETIONS, json=_counting(stream=False), timeout=1.0)
        except requests.exceptions.ReadTimeout:
            gave_up += 1
    assert gave_up == 5
    hold.set()
    for t in holders:
        t.join(120)
    info = _no_decoding_left(30)
    assert sum(info["outcomes"].values()) - before == SLOTS, info["outcomes"]
    _answers_exactly(server, served[1])
