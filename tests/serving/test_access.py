"""Hostile input against the ingress's FastAPI app without Ray: API keys, Host allow-list, docs, body
size, request limits, non-finite and out-of-range numbers, lone surrogates; and the verifier's
context-length check before prefill. Every refusal is an OpenAI-shaped error naming the field."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
import ray.serve

from taps_ray.config import ServeConfig
from taps_ray.serving import access, ingress, protocol
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
                  {"type": "done", "delta": "", "text": "ok", "finish_reason": "stop", "taps": TAPS,
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


async def _asgi(app, method: str, path: str, headers: dict, chunks: list[bytes]):
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
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
    assert set(error) == {"message", "type", "param", "code"}
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


def test_an_unhealthy_verifier_is_a_503_that_leaks_nothing(serve_app, monkeypatch):
    call = serve_app()

    async def down():
        raise RuntimeError("ActorDiedError: actor 9f3c at 10.0.0.7 pid 4242 /secret/path")

    monkeypatch.setattr(FakeVerifier, "info", property(lambda self: SimpleNamespace(remote=down)))
    status, _, data = call("GET", "/health")
    assert status == 503 and data == {"status": "unavailable", "detail": "the verifier did not answer"}


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_are_off_by_default_and_on_with_serve_docs(serve_app, path):
    status, _, data = serve_app()("GET", path)
    assert status == 404 and set(data["error"]) == {"message", "type", "param", "code"}
    assert serve_app(docs=True)("GET", path)[0] == 200
    assert serve_app(docs=True, keys=[KEY])("GET", path)[0] == 401


def test_models_shows_no_filesystem_paths(serve_app):
    status, _, data = serve_app()("GET", "/v1/models")
    assert status == 200 and "/secret" not in json.dumps(data)
    assert data["data"][0]["taps"]["drafters"] == {"a": {"checkpoint": None}, "b": {"checkpoint": "release:math"},
                                                   "c": {"checkpoint": "local"}}


@pytest.mark.parametrize("host, ok", [("api.example.com", True), ("API.example.com:8000", True),
                                      ("x.internal.net", True), ("evil.com", False), ("example.com.evil.com", False),
                                      ("", False), ("[::1]:8000", True)])
def test_host_allow_list(serve_app, host, ok):
    call = serve_app(allowed_hosts=["api.example.com", "*.internal.net", "[::1]"])
    result = call("POST", CHAT, chat(), {"host": host})
    if ok:
        assert result[0] == 200
    else:
        assert_error(result, 400, "Host")


# -- body size ------------------------------------------------------------------------------------

def test_an_oversized_body_is_413_with_content_length(serve_app):
    call = serve_app(max_body_bytes=4096)
    assert_error(call("POST", CHAT, chat(user="x" * 5000)), 413, "body")
    assert not call.verifier.requests


def test_an_oversized_chunked_body_without_content_length_is_413(serve_app):
    call = serve_app(max_body_bytes=4096)
    result = call("POST", CHAT, chunks=[b'{"model": "tiny", "messages": [', *[b" " * 1000] * 10, b"]}"])
    assert_error(result, 413, "body")
    ok = call("POST", CHAT, chunks=[b'{"model": "tiny", ', b'"messages": [{"role": "user", "content": "hi"}]}'])
    assert ok[0] == 200


def test_a_lying_content_length_is_400(serve_app):
    assert_error(serve_app()("POST", CHAT, b"{}", {"content-length": "-5"}), 400, "Content-Length")


# -- limits and values ----------------------------------------------------------------------------

LIMITS = dict(max_messages=4, max_prompt_chars=100, max_stop_sequences=2, max_stop_chars=8, max_tokens_cap=64,
              draft_deadline_s=1.0)


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
    cfg = ServeConfig(draft_deadline_s=1.0, max_draft_deadline_s=5.0)
    protocol.check_limits(protocol.ChatCompletionRequest(**chat(taps={"draft_deadline_s": 5.0})), cfg)
    with pytest.raises(protocol.RequestError, match="cap of 5 s"):
        protocol.check_limits(protocol.ChatCompletionRequest(**chat(taps={"draft_deadline_s": 5.5})), cfg)


def test_api_keys_are_not_dumped_and_resolve_with_the_env():
    cfg = ServeConfig(api_keys=["k1"])
    assert "api_keys" not in cfg.model_dump() and "k1" not in repr(cfg)
    assert access.resolve_api_keys(["k1"], {"TAPS_API_KEY": "k2, k1,,k3"}) == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="api_keys"):
        ServeConfig(api_keys=["has space"])


# -- context window before prefill ----------------------------------------------------------------

def test_a_prompt_longer_than_the_context_is_refused_before_prefill(monkeypatch):
    import taps_ray.serving.verifier as verifier_module

    target = bigram_target(0)
    monkeypatch.setattr(verifier_module, "generate", lambda *a, **k: pytest.fail("prefill ran"))
    verifier = object.__new__(Verifier)
    verifier.target, verifier.clients, verifier.cfg = target, {}, ServeConfig(drafters={"a": None})
    verifier.active, verifier._active_lock = 0, threading.Lock()
    events = []
    n = target.max_context + 3
    request = DecodeRequest(rid="r", prompt=[1] * n, plan=resolve_plan("vanilla", None, verifier.cfg), max_tokens=4,
                            sampling={}, stop=None, raw=True, prompt_param="prompt")
    verifier.decode(request, events.append)
    assert len(events) == 1 and events[0]["type"] == "error" and events[0]["status"] == 400
    assert events[0]["param"] == "prompt" and events[0]["code"] == "context_length_exceeded"
    assert str(n) in events[0]["message"] and str(target.max_context) in events[0]["message"]
