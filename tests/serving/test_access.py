"""Hostile input against the ingress's FastAPI app without Ray: API keys, Host allow-list, docs, body
size, request limits, non-finite and out-of-range numbers, lone surrogates; and the verifier's
context-length check before prefill. Every refusal is an OpenAI-shaped error naming the field."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace

import pytest
import ray.serve

from taps_ray.config import ServeConfig, TreeConfig
from taps_ray.serving import access, ingress, protocol
from taps_ray.serving import status as serving_status
from taps_ray.serving.plan import DecodeRequest, resolve_plan
from taps_ray.serving.verifier import Verifier
from tests.spec.spec_helpers import bigram_target

MODEL = "tiny"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
KEY = "sk-test-123"
TAPS = {"strategy": "single", "steps": 1, "drafted_steps": 1, "draft_tokens": 1, "accepted_tokens": 1,
        "plain_steps": 0, "accept_lengths": [1], "route_decisions": {}, "skipped": {}, "tau": 1.0}


class FakeVerifier:
    """A verifier handle whose ``generate`` streams start, one delta and done; ``requests`` records calls."""

    def __init__(self):
        self.requests: list[DecodeRequest] = []
        self.taps = TAPS

    def options(self, **kwargs):
        return self

    @property
    def generate(self):
        return SimpleNamespace(remote=self._generate)

    @property
    def info(self):
        async def remote():
            return {"max_context": 2048}
        return SimpleNamespace(remote=remote)

    def _generate(self, request: DecodeRequest):
        self.requests.append(request)
        events = [{"type": "start"}, {"type": "delta", "text": "ok"},
                  {"type": "done", "delta": "", "text": "ok", "finish_reason": "stop", "taps": self.taps,
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}]

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                if not events:
                    raise StopAsyncIteration
                return events.pop(0)

            def cancel(self):
                pass

        return Stream()


def _no_cluster(*args, **kwargs):
    """This in-process ingress has no cluster: Serve's handle lookup would start a default Ray cluster (2 CPUs)
    that a later test's ``ray_session`` in the same process would then join, too small for its application."""
    raise RuntimeError("no Ray cluster in this test")


@pytest.fixture
def serve_app(monkeypatch):
    """``make(keys=..., **serve_fields)``: configure an ingress instance and return an async caller
    ``call(method, path, body=None, headers=None, chunks=None) -> (status, headers, json)``."""
    from taps_ray.serving.ingress import Ingress

    def make(keys=(), env: str | None = None, **fields):
        if env is None:
            monkeypatch.delenv(access.ENV_KEYS, raising=False)
        else:
            monkeypatch.setenv(access.ENV_KEYS, env)
        cfg = ServeConfig(drafters={"a": None, "b": "release:math", "c": "/secret/runs/drafter"}, **fields)
        instance = Ingress.__mro__[1](FakeVerifier(), cfg.model_dump(), {}, MODEL, [], list(keys))
        monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(servable_object=instance))
        monkeypatch.setattr(ingress.serve, "get_deployment_handle", _no_cluster)

        def call(method, path, body=None, headers=None, chunks=None):
            headers = {"host": "testserver", **(headers or {})}
            if chunks is None:
                raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
                chunks = [raw]
                headers.setdefault("content-length", str(len(raw)))
            headers.setdefault("content-type", "application/json")
            return asyncio.run(_asgi(ingress.app, method, path, headers, chunks))

        call.verifier = instance.verifier
        return call

    return make


async def _asgi(app, method: str, path: str, headers: dict, chunks: list[bytes], finished: bool = True):
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or not finished}
               for i, c in enumerate(chunks)]  # not finished: the client stops sending mid-body
    hang = asyncio.Event()
    start, body = {}, []

    async def receive():
        if pending:
            return pending.pop(0)
        await hang.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            start.update(message)
        else:
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    response_headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    data = b"".join(body)
    is_json = response_headers.get("content-type", "").startswith("application/json")
    return start["status"], response_headers, json.loads(data) if data and is_json else data


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": MESSAGES, **extra}


def assert_error(result, status: int, param: str | None):
    code, _, data = result
    assert code == status, data
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert isinstance(error["request_id"], str) and error["request_id"]
    assert error["param"] == param and isinstance(error["message"], str) and error["type"].endswith("_error")
    if param is not None:
        assert param in error["message"]
    assert "Traceback" not in error["message"] and "/secret" not in error["message"]
    return error


# -- access ---------------------------------------------------------------------------------------

def test_open_without_keys_and_a_normal_request_works(serve_app):
    call = serve_app()
    status, _, data = call("POST", CHAT, chat(max_tokens=4))
    assert status == 200 and data["choices"][0]["message"]["content"] == "ok"
    assert call.verifier.requests[0].max_tokens == 4


@pytest.mark.parametrize("headers", [
    {}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}, {"authorization": KEY},
    {"authorization": "Bearer "}, {"authorization": f"Bearer {KEY}x"}, {"authorization": "Bearer sk-\u00e9"},
])
@pytest.mark.parametrize("path, method", [(CHAT, "POST"), ("/v1/models", "GET"), ("/metrics", "GET")])
def test_a_missing_or_wrong_key_is_401(serve_app, headers, path, method):
    call = serve_app(keys=[KEY])
    status, response_headers, _ = result = call(method, path, chat() if method == "POST" else None, headers)
    error = assert_error(result, 401, "Authorization")
    assert error["code"] == "invalid_api_key" and response_headers["www-authenticate"] == "Bearer"
    assert not call.verifier.requests


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
@pytest.mark.parametrize("keys, env, key", [([KEY], None, KEY), (["other", KEY], None, KEY),
                                            ([], f"k1, {KEY}", KEY), (["k0"], "k1", "k1")])
def test_any_configured_key_is_accepted(serve_app, scheme, keys, env, key):
    call = serve_app(keys=keys, env=env)
    status, _, data = call("POST", CHAT, chat(), {"authorization": f"{scheme} {key}"})
    assert status == 200, data


def test_health_is_open_without_a_key(serve_app):
    call = serve_app(keys=[KEY])
    assert call("GET", "/health") == (200, {"content-length": "15", "content-type": "application/json"},
                                      {"status": "ok"})


def test_a_key_holding_its_share_of_the_slots_is_refused_and_counted_per_key(serve_app):
    other = "sk-other-456"
    call = serve_app(keys=[KEY, other], admission={"max_requests_per_key": 1})
    instance = ray.serve.get_replica_context().servable_object
    mine = access.key_fingerprint(KEY.encode())
    assert ingress.per_key_limit(ServeConfig(), 2, 16) == 15 and ingress.per_key_limit(ServeConfig(), 1, 16) is None
    hold = instance.admission.admit(mine)  # a request of this key still decoding
    error = assert_error(call("POST", CHAT, chat(), {"authorization": f"Bearer {KEY}"}), 429, None)
    assert "this API key already has 1 requests in progress" in error["message"] and KEY not in json.dumps(error)
    assert call("POST", CHAT, chat(), {"authorization": f"Bearer {other}"})[0] == 200
    page = call("GET", "/metrics", None, {"authorization": f"Bearer {other}"})[2].decode()
    assert f'taps_key_refusals_total{{key="{mine}",model_name="{MODEL}"}} 1.0' in page
    hold()
    assert call("POST", CHAT, chat(), {"authorization": f"Bearer {KEY}"})[0] == 200


def test_a_burst_of_probes_asks_the_controller_and_the_drafters_once(serve_app, monkeypatch):
    serve_app()  # configures the in-process ingress
    asked = {"controller": 0, "drafters": 0}

    async def running(self):
        asked["controller"] += 1
        await asyncio.sleep(0.05)
        return {"Verifier": 1, "Drafter_a": 1, "Drafter_b": 1, "Drafter_c": 1}

    async def stats(self, app_name, name):
        asked["drafters"] += 1
        await asyncio.sleep(0.05)
        return []

    monkeypatch.setattr(ingress.Ingress.__mro__[1], "running_replicas", running)
    monkeypatch.setattr(ingress.Ingress.__mro__[1], "_drafter_stats", stats)

    async def burst(path: str) -> list:
        return await asyncio.gather(*(_asgi(ingress.app, "GET", path, {"host": "testserver"}, [b""])
                                      for _ in range(12)))

    assert {r[0] for r in asyncio.run(burst("/ready"))} == {200}
    assert {r[0] for r in asyncio.run(burst("/v1/models"))} == {200}
    assert asked == {"controller": 1, "drafters": 3}, asked  # one fill each, three drafters in it


def test_health_does_not_ask_the_verifier_and_ready_leaks_nothing(serve_app, monkeypatch):
    """Liveness is the ingress's own answer (a busy or dead verifier does not make it fail); readiness
    asks the controller, and a controller that fails is a 503 whose body names no actor, IP or path."""
    call = serve_app(keys=[KEY])

    async def down():
        raise RuntimeError("ActorDiedError: actor 9f3c at 10.0.0.7 pid 4242 /secret/path")

    async def no_controller(self):
        raise RuntimeError("controller 10.0.0.7:6379 pid 4242 unreachable")

    monkeypatch.setattr(FakeVerifier, "info", property(lambda self: SimpleNamespace(remote=down)))
    monkeypatch.setattr(ingress.Ingress.__mro__[1], "running_replicas", no_controller)
    assert call("GET", "/health")[:3:2] == (200, {"status": "ok"})
    status, headers, data = call("GET", "/ready")
    assert status == 503 and headers["retry-after"] == "1" and data == {"status": "not_ready"}
    status, headers, data = call("GET", "/ready", headers={"authorization": f"Bearer {KEY}"})
    assert status == 503 and headers["retry-after"] == "1"
    assert data == {"status": "not_ready", "verifier": "down", "drafters": {"a": "down", "b": "down", "c": "down"}}


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_are_off_by_default_and_on_with_serve_docs(serve_app, path):
    status, _, data = serve_app()("GET", path)
    assert status == 404 and set(data["error"]) == {"message", "type", "param", "code", "request_id"}
    assert serve_app(http={"docs": True})("GET", path)[0] == 200
    assert serve_app(http={"docs": True}, keys=[KEY])("GET", path)[0] == 401


def test_models_shows_no_filesystem_paths(serve_app):
    status, _, data = serve_app()("GET", "/v1/models")
    assert status == 200 and "/secret" not in json.dumps(data)
    none = {"version": None, "replicas": {}}  # no drafter replica answers this in-process ingress
    assert data["data"][0]["taps"]["drafters"] == {"a": {"checkpoint": None, **none},
                                                   "b": {"checkpoint": "release:math", **none},
                                                   "c": {"checkpoint": "local", **none}}


@pytest.mark.parametrize("host, ok", [("api.example.com", True), ("API.example.com:8000", True),
                                      ("x.internal.net", True), ("evil.com", False), ("example.com.evil.com", False),
                                      ("", False), ("[::1]:8000", True)])
def test_host_allow_list(serve_app, host, ok):
    call = serve_app(http={"allowed_hosts": ["api.example.com", "*.internal.net", "[::1]"]})
    result = call("POST", CHAT, chat(), {"host": host})
    if ok:
        assert result[0] == 200
    else:
        assert_error(result, 400, "Host")


@pytest.mark.parametrize("header", ["x-request-disconnect-disabled", "X-Request-Timeout-Seconds"])
def test_headers_that_would_let_a_client_hold_a_slot_are_refused(serve_app, header):
    call = serve_app()
    value = "?1" if "disconnect" in header.lower() else "100000"
    assert_error(call("POST", CHAT, chat(), {header: value}), 400, header.lower())
    assert_error(call("GET", "/v1/models", None, {header: value}), 400, header.lower())
    assert call("POST", CHAT, chat())[0] == 200


def test_a_token_id_prompt_counts_against_a_token_limit_at_the_ingress(serve_app):
    call = serve_app(limits={"max_prompt_tokens": 64})
    body = {"model": MODEL, "prompt": list(range(2, 70)), "max_tokens": 2}
    error = assert_error(call("POST", "/v1/completions", body), 400, "prompt")
    assert "68 token ids; at most 64" in error["message"] and not call.verifier.requests
    assert call("POST", "/v1/completions", {**body, "prompt": list(range(2, 66))})[0] == 200


@pytest.mark.parametrize("stream", [False, True])
def test_acceptance_figures_are_withheld_from_responses_when_capture_is_on_or_a_drafter_is_adapted(serve_app, stream):
    """Drafters adapted on captured traffic would tell one client, through tau and accept lengths, what they
    learned from others': withheld by default with capture on or when an adapted version drafted the request
    (capture off, the version promoted into this server), shown when the operator turns them on."""
    def taps_of(call) -> dict:
        status, _, data = call("POST", CHAT, chat(stream=stream))
        assert status == 200, data
        if not stream:
            return data["taps"]
        events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
        return next(e["taps"] for e in events if "taps" in e)

    assert taps_of(serve_app())["accept_lengths"] == [1]
    withheld = taps_of(serve_app(capture={"enabled": True}))
    assert withheld == {"strategy": "single", "skipped": {}, "acceptance": "withheld"}
    assert taps_of(serve_app(capture={"enabled": True}, show_acceptance=True))["tau"] == 1.0
    assert "tau" not in taps_of(serve_app(show_acceptance=False))
    adapted = serve_app()
    adapted.verifier.taps = {**TAPS, "adapted": True}
    assert taps_of(adapted) == {"strategy": "single", "skipped": {}, "adapted": True, "acceptance": "withheld"}
    adapted = serve_app(show_acceptance=True)
    adapted.verifier.taps = {**TAPS, "adapted": True}
    assert taps_of(adapted)["accept_lengths"] == [1]


# -- body size ------------------------------------------------------------------------------------

def test_a_body_not_received_in_time_is_408_and_decodes_nothing(serve_app):
    """A client that trickles (here: stops sending mid-body) cannot hold an ingress slot past body_timeout_s."""
    call = serve_app(http={"body_timeout_s": 0.2})
    started = time.monotonic()
    result = asyncio.run(_asgi(ingress.app, "POST", CHAT, {"host": "testserver", "content-type": "application/json"},
                               [b'{"model": "', b"smol"], finished=False))
    assert time.monotonic() - started < 5
    assert_error(result, 408, "body")
    assert result[1]["connection"] == "close" and not call.verifier.requests
    assert call("POST", CHAT, chat())[0] == 200


def test_an_oversized_body_is_413_with_content_length(serve_app):
    call = serve_app(http={"max_body_bytes": 4096})
    assert_error(call("POST", CHAT, chat(user="x" * 5000)), 413, "body")
    assert not call.verifier.requests


def test_an_oversized_chunked_body_without_content_length_is_413(serve_app):
    call = serve_app(http={"max_body_bytes": 4096})
    result = call("POST", CHAT, chunks=[b'{"model": "tiny", "messages": [', *[b" " * 1000] * 10, b"]}"])
    assert_error(result, 413, "body")
    ok = call("POST", CHAT, chunks=[b'{"model": "tiny", ', b'"messages": [{"role": "user", "content": "hi"}]}'])
    assert ok[0] == 200


def test_a_lying_content_length_is_400(serve_app):
    assert_error(serve_app()("POST", CHAT, b"{}", {"content-length": "-5"}), 400, "Content-Length")


# -- limits and values ----------------------------------------------------------------------------

LIMITS = dict(limits=dict(max_messages=4, max_prompt_chars=100, max_stop_sequences=2, max_stop_chars=8,
                          max_tokens_cap=64), routing=dict(draft_deadline_s=1.0))


@pytest.mark.parametrize("body, param", [
    (chat(messages=MESSAGES * 5), "messages"),
    (chat(messages=[{"role": "user", "content": "x" * 101}]), "messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 60}] * 2}]), "messages"),
    ({"model": MODEL, "prompt": "y" * 101}, "prompt"),
    (chat(stop=["a", "b", "c"]), "stop"),
    (chat(stop="123456789"), "stop"),
    (chat(stop=[""]), "stop"),
    (chat(max_tokens=65), "max_tokens"),
    (chat(max_completion_tokens=10 ** 30), "max_completion_tokens"),
    (chat(max_tokens=1e400), "max_tokens"),
    (chat(taps={"draft_deadline_s": 1.5}), "taps.draft_deadline_s"),
    (chat(taps={"draft_deadline_s": float("inf")}), "taps.draft_deadline_s"),
    (chat(taps={"draft_deadline_s": -1}), "taps.draft_deadline_s"),
    (chat(temperature=float("nan")), "temperature"),
    (chat(temperature=float("inf")), "temperature"),
    (chat(temperature=-0.5), "temperature"),
    (chat(temperature=1e-300), "temperature"),
    (chat(temperature=2.5), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=float("nan")), "top_p"),
    (chat(top_p=1.0000001), "top_p"),
    (chat(seed=2 ** 63), "seed"),
    (chat(seed=-(2 ** 63) - 1), "seed"),
    (chat(seed=10 ** 40), "seed"),
    (chat(presence_penalty=float("nan")), "presence_penalty"),
    (chat(messages=[{"role": "user", "content": "a\ud800b"}]), "messages.0.content"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]), "messages.0.content"),
    (chat(stop=["ok", "\ud83d"]), "stop"),
    (chat(model="ti\udc00ny"), "model"),
    (chat(user="\ud800"), "user"),
    ({"model": MODEL, "prompt": "\ud800"}, "prompt"),
    (chat(taps={"strategy": "\ud800"}), "taps.strategy"),
])
def test_hostile_values_are_400s_naming_the_field(serve_app, body, param):
    call = serve_app(**LIMITS)
    path = "/v1/completions" if "prompt" in body else CHAT
    raw = json.dumps(body).encode()
    error = assert_error(call("POST", path, raw), 400, param)
    assert error["message"].startswith(param.split(".")[0])
    assert not call.verifier.requests


@pytest.mark.parametrize("body", [chat(temperature=0), chat(temperature=0.01), chat(temperature=2), chat(top_p=1),
                                  chat(seed=2 ** 63 - 1), chat(seed=-(2 ** 63)), chat(max_tokens=64),
                                  chat(stop=["a", "12345678"]), chat(taps={"draft_deadline_s": 1.0}),
                                  chat(messages=MESSAGES * 4), chat(messages=[{"role": "user", "content": "é😀"}])])
def test_values_at_the_limits_are_accepted(serve_app, body):
    status, _, data = serve_app(**LIMITS)("POST", CHAT, json.dumps(body).encode())
    assert status == 200, data


def test_max_draft_deadline_s_raises_the_bound():
    cfg = ServeConfig(routing={"draft_deadline_s": 1.0, "max_draft_deadline_s": 5.0})
    protocol.check_limits(protocol.ChatCompletionRequest(**chat(taps={"draft_deadline_s": 5.0})), cfg)
    with pytest.raises(protocol.RequestError, match="cap of 5 s"):
        protocol.check_limits(protocol.ChatCompletionRequest(**chat(taps={"draft_deadline_s": 5.5})), cfg)


def test_api_keys_are_not_dumped_and_resolve_with_the_env():
    cfg = ServeConfig(http={"api_keys": ["k1"]})
    assert "api_keys" not in cfg.model_dump() and "k1" not in repr(cfg)
    assert access.resolve_api_keys(["k1"], {"TAPS_API_KEY": "k2, k1,k3"}) == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="api_keys"):
        ServeConfig(http={"api_keys": ["has space"]})


@pytest.mark.parametrize("secret", ["", "   ", "k1,,k2", "k1, "])
def test_a_blank_key_secret_is_an_error_not_an_open_endpoint(secret):
    with pytest.raises(ValueError, match="TAPS_API_KEY is set but holds an empty or blank key"):
        access.resolve_api_keys([], {"TAPS_API_KEY": secret})
    assert access.resolve_api_keys([], {}) == []


def test_binding_beyond_loopback_without_keys_is_refused_unless_allowed_explicitly():
    for host in ("127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]"):
        assert access.is_loopback(host) and access.exposure_refusal(host, [], False) is None
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.com"):
        assert not access.is_loopback(host)
        assert "refusing to serve on" in access.exposure_refusal(host, [], False)
        assert access.exposure_refusal(host, ["k1"], False) is None
        assert access.exposure_refusal(host, [], True) is None


def test_taps_serve_refuses_a_public_bind_without_keys_before_starting_anything(monkeypatch, capsys):
    """Through the CLI: exit 2 with the reason; Ray is never started (a started cluster fails the test)."""
    from taps_ray import cli
    from taps_ray.runtime import cluster

    monkeypatch.delenv("TAPS_API_KEY", raising=False)
    monkeypatch.setattr(cluster, "init_ray", lambda *a, **k: pytest.fail("Ray started for a refused bind"))
    assert cli.main(["serve", "configs/demo.yaml", "--host", "0.0.0.0"]) == 2
    assert "refusing to serve on '0.0.0.0' without API keys" in capsys.readouterr().err
    monkeypatch.setenv("TAPS_API_KEY", " ")
    assert cli.main(["serve", "configs/demo.yaml"]) == 2
    assert "TAPS_API_KEY is set but holds an empty or blank key" in capsys.readouterr().err


@pytest.fixture
def controller_binds(monkeypatch):
    """``bound(host)``: the Serve controller says its HTTP proxies bind ``host`` (None: no controller runs); no
    key in the environment."""
    from taps_ray.runtime import ray_compat

    monkeypatch.delenv(access.ENV_KEYS, raising=False)

    def bound(host: str | None) -> None:
        monkeypatch.setattr(ray_compat, "serve_http_host", lambda: host)

    return bound


def _ingress(**fields):
    cfg = ServeConfig(drafters={"a": None}, **fields)
    return ingress.Ingress.__mro__[1](FakeVerifier(), cfg.model_dump(), {}, MODEL, [], [])


def test_serve_deploy_refuses_a_public_address_without_keys_like_taps_serve(controller_binds, monkeypatch):
    """The Serve config path (``build_app``, then each ingress replica) fails closed on the address the Serve
    controller's HTTP proxies bind: beyond loopback without API keys, the builder raises before any deployment
    starts and an ingress replica does not start; keys or ``serve.http.allow_unauthenticated`` let both go ahead."""
    from ray.serve import Application

    from taps_ray.config import ConfigError
    from taps_ray.serving.app import AppArgs, build_app

    args = {"experiment": {"serve": {"drafters": {"a": None}}}}
    controller_binds("0.0.0.0")
    with pytest.raises(ConfigError, match="refusing to serve on '0.0.0.0' without API keys"):
        build_app(args)
    with pytest.raises(ValueError, match="refusing to serve on '0.0.0.0' without API keys"):
        _ingress()
    assert isinstance(build_app(AppArgs(**args, overrides=["serve.http.allow_unauthenticated=true"])), Application)
    monkeypatch.setenv(access.ENV_KEYS, KEY)
    assert isinstance(build_app(args), Application) and _ingress().keyed
    monkeypatch.delenv(access.ENV_KEYS)
    controller_binds("127.0.0.1")
    assert isinstance(build_app(args), Application) and not _ingress().keyed
    controller_binds(None)
    with pytest.raises(ValueError, match="refusing to serve on '10.0.0.5'"):
        _ingress(http={"host": "10.0.0.5"})
    assert not _ingress().keyed, "without a controller (built in-process) serve.http.host is the address checked"


def test_allow_unauthenticated_serves_a_public_address_open_with_a_loud_warning(controller_binds, caplog):
    controller_binds("0.0.0.0")
    with caplog.at_level(logging.WARNING, logger=ingress.log.name):
        instance = _ingress(http={"allow_unauthenticated": True})
    assert not instance.keyed
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [access.open_warning("0.0.0.0")]
    assert "allow_unauthenticated is set" in warned[0] and "'0.0.0.0'" in warned[0] and "WITHOUT API keys" in warned[0]
    caplog.clear()
    controller_binds("127.0.0.1")
    with caplog.at_level(logging.WARNING, logger=ingress.log.name):
        _ingress(http={"allow_unauthenticated": True})
    assert [r.getMessage() for r in caplog.records] == [access.open_warning("127.0.0.1")]
    assert "allow_unauthenticated" not in access.open_warning("127.0.0.1")


# -- context window before prefill ----------------------------------------------------------------

def test_a_prompt_longer_than_the_context_is_refused_before_prefill(monkeypatch):
    import taps_ray.serving.session as session_module

    target = bigram_target(0)
    monkeypatch.setattr(session_module, "generate", lambda *a, **k: pytest.fail("prefill ran"))
    verifier = object.__new__(Verifier)
    verifier.target, verifier.clients, verifier.cfg = target, {}, ServeConfig(drafters={"a": None})
    verifier.tree = TreeConfig(adaptive=False)
    verifier._init_counts()
    events = []
    n = target.max_context + 3
    request = DecodeRequest(rid="r", prompt=[1] * n, plan=resolve_plan("vanilla", None, verifier.cfg), max_tokens=4,
                            sampling={}, stop=None, raw=True, prompt_param="prompt")
    verifier.decode(request, events.append)
    assert len(events) == 1 and events[0]["type"] == "error" and events[0]["status"] == 400
    assert events[0]["param"] == "prompt" and events[0]["code"] == "context_length_exceeded"
    assert str(n) in events[0]["message"] and str(target.max_context) in events[0]["message"]


# -- load shedding, deadlines, cancellation and errors that leak nothing --------------------------

SECRET = "RayActorError: actor 9f3c0a at 10.0.0.7 pid 4242 in /secret/runs/drafter"


class Scripted:
    """A verifier stream playing ``script``: event dicts, exceptions to raise, or ``"hang"`` (wait
    until cancelled); ``cancelled`` counts :meth:`cancel` calls, which raise ``cancel_raises`` (as
    Serve's ``cancel()`` re-raises a failed assignment's error)."""

    def __init__(self, script: list, cancel_raises: Exception | None = None):
        self.script = list(script)
        self.cancelled = 0
        self.cancel_raises = cancel_raises

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.script:
            raise StopAsyncIteration
        step = self.script.pop(0)
        if step == "hang":
            await asyncio.Event().wait()
        if isinstance(step, BaseException):
            raise step
        return step

    def cancel(self):
        self.cancelled += 1
        if self.cancel_raises is not None:
            raise self.cancel_raises


def scripted(call, *script, cancel_raises: Exception | None = None) -> list[Scripted]:
    """Make ``call``'s verifier answer every request with a fresh :class:`Scripted` stream; the streams made."""
    made: list[Scripted] = []

    def generate(request):
        call.verifier.requests.append(request)
        made.append(Scripted(script, cancel_raises))
        return made[-1]

    call.verifier._generate = generate
    return made


START, DELTA = {"type": "start"}, {"type": "delta", "text": "ok"}


def sse_events(data: bytes) -> list:
    lines = [line.removeprefix(b"data: ") for line in data.split(b"\n\n") if line.startswith(b"data: ")]
    return [line.decode() if line == b"[DONE]" else json.loads(line) for line in lines]


def test_a_full_queue_is_a_429_at_once_with_retry_after(serve_app):
    from ray.serve.exceptions import BackPressureError

    call = serve_app(admission={"max_queued_requests": 3, "retry_after_s": 2.5})
    full = BackPressureError(num_queued_requests=3, max_queued_requests=3, status_code=429)
    streams = scripted(call, full, cancel_raises=full)
    status, headers, _ = result = call("POST", CHAT, chat(stream=True), {"x-request-id": "burst-7"})
    error = assert_error(result, 429, None)
    assert headers["retry-after"] == "3" and error["code"] == "server_busy" and error["request_id"] == "burst-7"
    assert "retry after 3 s" in error["message"] and "num_queued" not in error["message"]
    assert streams[0].cancelled == 1
    metrics = call("GET", "/metrics")[2].decode()
    assert 'taps_request_failure_total{model_name="tiny",status="429"} 1.0' in metrics


def test_the_deadline_counts_from_arrival_and_ends_the_wait_in_the_queue(serve_app):
    call = serve_app(limits={"request_timeout_s": 0.2})
    streams = scripted(call, "hang")
    error = assert_error(call("POST", CHAT, chat()), 504, None)
    assert error["code"] == "timeout" and streams[0].cancelled == 1
    request = call.verifier.requests[0]
    assert request.expires_at is not None and request.request_id == error["request_id"]
    metrics = call("GET", "/metrics")[2].decode()
    assert 'taps_request_aborted_total{model_name="tiny",reason="timeout"} 1.0' in metrics
    assert 'taps_num_requests_waiting{model_name="tiny"} 0.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("script, status", [
    ([RuntimeError(SECRET)], 503),                                     # the verifier cannot be reached
    ([START, DELTA, RuntimeError(SECRET)], 500),                       # it dies while decoding
    ([START, {"type": "error", "status": 500, "message": SECRET, "param": None, "code": None,
              "error_type": "server_error"}], 500),                    # it reports an internal error
    ([START, DELTA], 500),                                             # its stream ends without a result
])
def test_an_internal_error_is_generic_for_the_client_and_detailed_in_the_log(serve_app, caplog, script, status,
                                                                             stream):
    caplog.set_level(logging.INFO)
    call = serve_app()
    scripted(call, *script)
    code, _, data = call("POST", CHAT, chat(stream=stream), {"x-request-id": "abc-123"})
    if stream and status == 500:
        assert code == 200
        events = sse_events(data)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        error = events[-2]["error"]
    else:
        error = assert_error((code, None, data), status, None)
    assert error["type"] == "server_error" and error["request_id"] == "abc-123" and "abc-123" in error["message"]
    assert SECRET not in json.dumps(data if isinstance(data, dict) else data.decode())
    for leak in ("10.0.0.7", "4242", "9f3c0a", "/secret", "Traceback", "RuntimeError"):
        assert leak not in error["message"]
    if isinstance(script[-1], RuntimeError):
        logged = [r for r in caplog.records if "abc-123" in r.getMessage()]
        assert logged and any(r.exc_info and SECRET in str(r.exc_info[1]) for r in logged)


def test_an_exception_escaping_a_route_is_a_generic_500(serve_app, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    call = serve_app()

    def broken(self):
        raise ValueError(SECRET)

    monkeypatch.setattr(serving_status, "public_checkpoint", broken)
    status, _, data = call("GET", "/v1/models", headers={"x-request-id": "models-1"})
    assert status == 500 and data["error"]["request_id"] == "models-1" and SECRET not in json.dumps(data)
    assert any("models-1" in r.getMessage() and SECRET in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


@pytest.mark.parametrize("given, kept", [("req-42.a:b", True), ("x" * 129, False), ("bad id\nforged log", False),
                                         ("", False), ("é", False)])
def test_the_request_id_is_the_plain_x_request_id_or_a_fresh_one(serve_app, given, kept):
    call = serve_app()
    error = assert_error(call("POST", CHAT, chat(n=2), {"x-request-id": given}), 400, "n")
    assert (error["request_id"] == given) is kept and "\n" not in error["request_id"]


@pytest.mark.parametrize("method, path, status", [("GET", "/v2/nothing", 404), ("GET", CHAT, 405),
                                                  ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods_are_openai_shaped(serve_app, method, path, status):
    error = assert_error(serve_app()(method, path), status, None)
    assert error["type"].endswith("_error") and path in error["message"]


def test_health_is_ok_while_the_verifier_is_busy_and_ready_reports_components(serve_app, monkeypatch):
    call = serve_app()
    scripted(call, "hang")

    async def busy():
        await asyncio.Event().wait()

    monkeypatch.setattr(FakeVerifier, "info", property(lambda self: SimpleNamespace(remote=busy)))
    running = {"Verifier": 1, "Drafter_a": 1, "Drafter_b": 0, "Drafter_c": 2, "Ingress": 1}
    async def replicas(self):
        return running

    monkeypatch.setattr(ingress.Ingress.__mro__[1], "running_replicas", replicas)
    assert call("GET", "/health")[:3:2] == (200, {"status": "ok"})
    assert call("GET", "/ready")[:3:2] == (200, {"status": "degraded", "verifier": "up",
                                                 "drafters": {"a": "up", "b": "down", "c": "up"}})


def test_with_keys_ready_tells_a_keyless_probe_the_status_alone(serve_app, monkeypatch):
    """Probes need no key; which drafters are up is for key holders; a wrong key on a probe route is still 401."""
    call = serve_app(keys=["k1"])
    running = {"Verifier": 1, "Drafter_a": 1, "Drafter_b": 0, "Drafter_c": 1}

    async def replicas(self):
        return running

    monkeypatch.setattr(ingress.Ingress.__mro__[1], "running_replicas", replicas)
    assert call("GET", "/ready")[:3:2] == (200, {"status": "degraded"})
    assert call("GET", "/health")[:3:2] == (200, {"status": "ok"})
    full = call("GET", "/ready", headers={"authorization": "Bearer k1"})
    assert full[:3:2] == (200, {"status": "degraded", "verifier": "up", "drafters": {"a": "up", "b": "down", "c": "up"}})
    assert_error(call("GET", "/ready", headers={"authorization": "Bearer nope"}), 401, "Authorization")
    assert call("GET", "/metrics")[0] == 401
    running.pop("Verifier")
    ingress.READY_CACHE_S, cache = 0.0, ingress.READY_CACHE_S
    try:
        call = serve_app(keys=["k1"])
        status, _, body = call("GET", "/ready")
    finally:
        ingress.READY_CACHE_S = cache
    assert (status, body) == (503, {"status": "not_ready"})


def test_readiness_report():
    assert serving_status.readiness({"Verifier": 2, "Drafter_m": 1}, ["m"]) == {
        "status": "ready", "verifier": "up", "drafters": {"m": "up"}}
    assert serving_status.readiness({"Drafter_m": 1}, ["m"])["status"] == "not_ready"
    assert serving_status.readiness({"Verifier": 1}, ["m"])["status"] == "degraded"


def test_ingress_limits_leave_room_for_probes_beyond_the_verifier_queue():
    from taps_ray.serving.app import INGRESS_HEADROOM, ingress_limits

    cfg = ServeConfig(drafters={"a": None}, admission={"max_concurrent_requests": 3, "max_queued_requests": 5},
                      verifier={"num_replicas": 2})
    ongoing, queued = ingress_limits(cfg)
    assert ongoing == 2 * 3 + 5 + INGRESS_HEADROOM and queued == ongoing


# -- the verifier: cancellation before prefill and within a step, generic internal errors --------

def _verifier(target, **fields) -> Verifier:
    from concurrent.futures import ThreadPoolExecutor

    from taps_ray.config import TreeConfig

    verifier = object.__new__(Verifier)
    verifier.target, verifier.clients = target, {}
    verifier.cfg = ServeConfig(drafters={"a": None}, **fields)
    verifier.tree = TreeConfig(lookup_tokens=0)
    verifier.pool = ThreadPoolExecutor(verifier.cfg.admission.max_concurrent_requests)
    verifier._init_counts()
    return verifier


def _vanilla(n: int = 8, max_tokens: int = 4, **fields) -> DecodeRequest:
    plan = resolve_plan("vanilla", None, ServeConfig(drafters={"a": None}))
    return DecodeRequest(rid="cmpl-x", prompt=list(range(2, 2 + n)), plan=plan, max_tokens=max_tokens, sampling={},
                         stop=None, raw=True, prompt_param="prompt", request_id="rq-1", **fields)


@pytest.fixture
def no_prefill(monkeypatch):
    import taps_ray.serving.session as session_module

    monkeypatch.setattr(session_module, "generate", lambda *a, **k: pytest.fail("prefill ran"))


def test_a_request_cancelled_before_it_starts_never_prefills(no_prefill):
    import threading

    verifier, events, cancel = _verifier(bigram_target(0)), [], threading.Event()
    cancel.set()
    verifier.decode(_vanilla(), events.append, cancel)
    assert events == [] and verifier.info()["outcomes"] == {"cancelled_before_prefill": 1}
    assert verifier.active == 0


def test_a_request_past_its_deadline_never_prefills(no_prefill):
    import time

    verifier, events = _verifier(bigram_target(0)), []
    verifier.decode(_vanilla(expires_at=time.time() - 1), events.append)
    assert [(e["type"], e["status"], e["code"]) for e in events] == [("error", 504, "timeout")]
    assert verifier.info()["outcomes"] == {"timeout_before_prefill": 1}


def test_an_internal_error_in_the_verifier_is_logged_not_sent(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    target = bigram_target(0)
    target.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    verifier, events = _verifier(target), []
    monkeypatch.setattr(target, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(SECRET)))
    verifier.decode(_vanilla(), events.append)
    assert events[-1] == {"type": "error", "status": 500, "message": "internal error", "param": None, "code": None,
                          "error_type": "server_error"}
    assert any("rq-1" in r.getMessage() and r.exc_info and SECRET in str(r.exc_info[1]) for r in caplog.records)
    assert verifier.info()["outcomes"] == {"failed": 1}


def test_closing_the_stream_stops_decoding_within_a_step_before_generate_returns(monkeypatch):
    """A hung-up client's stream is closed: the decode loop stops at its next step, and ``generate``
    returns only after it stopped, so the slot it frees is free (``active`` 0 as soon as it returns)."""
    from taps_ray.serving.drafting import RemoteStrategy

    target = bigram_target(0)
    target.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    steps, at_close = [0], []
    propose = RemoteStrategy.propose

    def slow_propose(self, state):
        steps[0] += 1
        import time
        time.sleep(0.02)
        return propose(self, state)

    monkeypatch.setattr(RemoteStrategy, "propose", slow_propose)
    verifier = _verifier(target)

    async def main():
        stream = verifier.generate(_vanilla(max_tokens=400))
        seen = [await stream.__anext__() for _ in range(3)]
        at_close.append(steps[0])
        await stream.aclose()
        return seen, verifier.active, dict(verifier.counts)

    seen, active, outcomes = asyncio.run(main())
    assert seen[0]["type"] == "start" and seen[1]["type"] == "delta"
    assert active == 0 and outcomes == {"cancelled": 1} and verifier.waiting == 0
    assert steps[0] <= at_close[0] + 1, "decoding went on after the stream was closed"


@pytest.mark.parametrize("stream", [False, True])
def test_a_verifier_refusal_before_decoding_is_its_4xx_naming_the_field(serve_app, stream):
    call = serve_app()
    scripted(call, {"type": "error", "status": 400, "message": "the prompt has 9000 tokens; at most 2047 fit",
                    "param": "prompt", "code": "context_length_exceeded", "error_type": "invalid_request_error"})
    error = assert_error(call("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "stream": stream}), 400,
                         "prompt")
    assert error["message"].startswith("prompt: the prompt has 9000 tokens") and error["code"] == "context_length_exceeded"
