"""A real ``taps serve`` (the CLI in a subprocess, joining this session's Ray cluster) answering over a socket:
a client that hangs up on a non-streamed request stops its decoding, and the ingress learned the address it
is served on from the Serve controller (``ray_compat.serve_http_host``, which a keyless ingress needs to
start)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
from ray import serve

from taps_ray.runtime import ray_compat
from tests.conftest import REPO
from tests.serving.helpers import free_port, metric

pytestmark = pytest.mark.integration

APP = "taps-cli"
MODEL = "smollm2-135m"
DISCONNECTS = 'taps_request_aborted_total{model_name="smollm2-135m",reason="disconnect"}'


def _until(check, within_s: float, what: str):
    deadline = time.monotonic() + within_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} not within {within_s:g} s"
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def taps_serve(ray_session, tmp_path_factory):
    """``taps serve configs/demo.yaml`` on a free local port with one untrained drafter, plain decoding and
    two decoding slots (one for the request, one for ``Verifier.info`` calls, which queue like requests):
    yields (base URL, port) once ``/ready`` says ready. Stopped with SIGTERM after (the
    command deletes its application), then Serve is shut down for the modules after this one."""
    port = free_port()
    log = tmp_path_factory.mktemp("taps_serve") / "serve.log"
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address, "PYTHONPATH": str(REPO)}
    env.pop("TAPS_API_KEY", None)
    cmd = [sys.executable, "-m", "taps_ray.cli", "serve", "configs/demo.yaml", "--port", str(port),
           f"serve.app_name={APP}", "serve.drafters={a: {seed: 0}}", "serve.strategy=vanilla", "target.threads=1",
           "target.dtype=float32", "serve.admission.max_concurrent_requests=2", "serve.limits.request_timeout_s=600"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, f"taps serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
        try:
            return requests.get(f"{url}/ready", timeout=5).json().get("status") == "ready"
        except (requests.RequestException, ValueError):
            return False

    try:
        _until(ready, 600, "taps serve ready")
        yield url, port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        serve.shutdown()


def _verifier() -> dict:
    return serve.get_deployment_handle("Verifier", APP).info.remote().result(timeout_s=30)


def test_a_non_streamed_request_whose_client_hangs_up_stops_decoding(taps_serve):
    """A non-streamed completion of 3000 tokens (minutes on this CPU) sent over a raw socket: once it decodes,
    the client closes the socket without reading. Within 15 s no decode loop runs, the verifier counts it
    cancelled (not finished), ``/metrics`` counts one disconnect, and the next request is answered."""
    url, port = taps_serve
    before = _verifier()["outcomes"]
    disconnects = metric(requests.get(f"{url}/metrics", timeout=30).text, DISCONNECTS)
    body = json.dumps({"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 3000, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _until(lambda: _verifier()["active"] == 1, 120, "decoding")
        time.sleep(2.0)
        assert _verifier()["active"] == 1, "it decodes for much longer than this"
    hung_up = time.monotonic()
    info = _until(lambda: (i := _verifier())["active"] == 0 and i["waiting"] == 0 and i, 15, "decoding stopped")
    new = {k: v - before.get(k, 0) for k, v in info["outcomes"].items() if v != before.get(k, 0)}
    assert new == {"cancelled": 1}, (new, time.monotonic() - hung_up)
    page = requests.get(f"{url}/metrics", timeout=30).text
    assert metric(page, DISCONNECTS) - disconnects == 1
    answer = requests.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "1, 2,", "max_tokens": 4,
                                                          "temperature": 0}, timeout=120)
    assert answer.status_code == 200 and 0 < answer.json()["usage"]["completion_tokens"] <= 4


def test_serve_http_host_is_the_address_the_serve_controller_binds(taps_serve):
    """What a keyless ingress (this one) and ``build_app`` check before they serve: the controller's answer."""
    assert ray_compat.serve_http_host() == "127.0.0.1"
