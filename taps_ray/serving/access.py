"""Checks every HTTP request passes before routing, as a pure ASGI middleware (no Ray): the Host
allow-list (400), Serve's proxy-control headers (400, :data:`PROXY_CONTROL_HEADERS`), the API key (401, every
route but the probes ``/health`` and ``/ready``, which check a key only when one is sent), the docs switch (404) and the
body-size cap (413, counted while reading, so chunked bodies without ``Content-Length`` too) and a total
deadline on reading the body (408: a client trickling its body cannot hold an ingress slot).
Answers are OpenAI-shaped error bodies (:func:`~taps_ray.serving.protocol.error_body`)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from taps_ray.config import ServeConfig
from taps_ray.serving.protocol import error_body

ENV_KEYS = "TAPS_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready"})
"""Probe routes: liveness and readiness answer without a key, saying nothing but up or down (``/ready`` shows
which components are up only to a request with a valid key, when the server has keys)."""
DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
KEY_STATE = "taps_key"
"""The request-scope state entry naming the API key a request authenticated with (its fingerprint)."""
PROXY_CONTROL_HEADERS = ("x-request-disconnect-disabled", "x-request-timeout-seconds")
"""Headers through which Serve's HTTP proxy lets a client keep a request running after it hangs up, or set
its own timeout: refused (400), so that no client can hold a decoding slot past the server's limits."""


def resolve_api_keys(configured: Iterable[str], environ: Mapping[str, str] = os.environ) -> list[str]:
    """``configured`` keys plus the comma-separated ``TAPS_API_KEY`` ones, deduplicated in order. ValueError
    when ``TAPS_API_KEY`` is set but holds an empty or blank key (a secret that did not arrive must not
    read as "no keys", which would open the endpoint)."""
    configured = list(configured)
    if ENV_KEYS in environ:
        parts = [k.strip() for k in environ[ENV_KEYS].split(",")]
        if not all(parts):
            raise ValueError(f"{ENV_KEYS} is set but holds an empty or blank key ({len(parts)} comma-separated "
                             f"entries, {parts.count('')} blank): give non-empty keys, or unset it")
        configured += parts
    return list(dict.fromkeys(configured))


def key_fingerprint(key: bytes) -> str:
    """A name for an API key that logs and metrics may show: ``key-`` and 8 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(key).hexdigest()[:8]


def request_key(scope) -> str | None:
    """The fingerprint of the API key the request authenticated with (None: the server has no keys)."""
    return (scope.get("state") or {}).get(KEY_STATE)


def is_loopback(host: str) -> bool:
    """Whether the bind address ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    name = host.strip().lower().strip("[]")
    return name == "localhost" or name == "::1" or name.startswith("127.")


def exposure_refusal(host: str, api_keys: Iterable[str], allow_unauthenticated: bool) -> str | None:
    """Why binding ``host`` must be refused (fail closed: beyond loopback only with API keys, unless
    ``serve.http.allow_unauthenticated``), or None when it may go ahead."""
    if is_loopback(host) or list(api_keys) or allow_unauthenticated:
        return None
    return (f"refusing to serve on {host!r} without API keys: anyone who can reach it could use the endpoint. "
            f"Give keys (serve.http.api_keys, --api-key or {ENV_KEYS}), bind 127.0.0.1, or set "
            f"serve.http.allow_unauthenticated=true to serve it open on purpose")


def open_warning(host: str) -> str:
    """The warning of an endpoint served on ``host`` without API keys (beyond loopback only with
    ``serve.http.allow_unauthenticated``, which :func:`exposure_refusal` requires)."""
    if is_loopback(host):
        return (f"no API keys (serve.http.api_keys, --api-key, {ENV_KEYS}): anyone who can reach {host} on this machine "
                f"may use the endpoint")
    return (f"serve.http.allow_unauthenticated is set: serving on {host!r}, beyond loopback, WITHOUT API keys: anyone "
            f"who can reach that address may use the endpoint")


@dataclass(frozen=True)
class AccessPolicy:
    """What :class:`AccessGuard` enforces; no ``api_keys`` means open access, no ``allowed_hosts`` any Host."""

    api_keys: tuple[bytes, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    docs: bool = False
    max_body_bytes: int = 2 * 1024 * 1024
    body_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: ServeConfig, api_keys: Iterable[str]) -> AccessPolicy:
        return cls(tuple(k.encode() for k in api_keys), tuple(h.lower() for h in cfg.http.allowed_hosts), cfg.http.docs,
                   cfg.http.max_body_bytes, cfg.http.body_timeout_s)

    def key_ok(self, token: bytes) -> bool:
        """Constant-time comparison against every key (no early exit)."""
        return self.matching_key(token) is not None

    def matching_key(self, token: bytes) -> bytes | None:
        """The configured key ``token`` equals (compared with every key, no early exit), or None."""
        found = None
        for key in self.api_keys:
            if hmac.compare_digest(token, key):
                found = key
        return found

    def host_ok(self, host: str | None) -> bool:
        if not self.allowed_hosts:
            return True
        name = _host_name(host or "")
        return bool(name) and any(name == h or (h.startswith("*.") and name.endswith(h[1:]))
                                  for h in self.allowed_hosts)


_policy: AccessPolicy | None = None


def configure(policy: AccessPolicy) -> None:
    """Install the policy this process's :class:`AccessGuard` enforces (the ingress replica calls it)."""
    global _policy
    _policy = policy


def current_policy() -> AccessPolicy | None:
    return _policy


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else ""
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class BodyTooLarge(Exception):
    pass


class AccessGuard:
    """ASGI middleware enforcing ``policy()`` (None: 503, the ingress is not configured yet)."""

    def __init__(self, app, policy: Callable[[], AccessPolicy | None] = current_policy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy()
        reply = self._refuse(scope, policy)
        if reply is None:
            try:
                receive = await asyncio.wait_for(self._buffer(scope, receive, policy.max_body_bytes),
                                                 policy.body_timeout_s)
            except BodyTooLarge:
                reply = _error(413, f"the request body exceeds the limit of {policy.max_body_bytes} bytes", "body",
                               "request_too_large")
            except TimeoutError:
                reply = _error(408, f"the request body was not received within {policy.body_timeout_s:g} s", "body",
                               "request_timeout", headers={"Connection": "close"})
        if reply is not None:
            await reply(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _refuse(scope, policy: AccessPolicy | None) -> JSONResponse | None:
        if policy is None:
            return _error(503, "the server is starting; retry shortly", None, "not_ready", "server_error")
        headers = Headers(scope=scope)
        path = scope.get("path", "/")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if not policy.host_ok(headers.get("host")):
            return _error(400, "Host: this server does not answer for the requested host name", "Host",
                          "host_not_allowed")
        for name in PROXY_CONTROL_HEADERS:
            if name in headers:
                return _error(400, f"{name}: this header is not accepted here (the server sets request timeouts "
                                   f"and cancels a request whose client disconnects)", name, "header_not_allowed")
        if policy.api_keys and (path not in OPEN_PATHS or "authorization" in headers):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return _unauthorized("Authorization: missing API key; send the header 'Authorization: Bearer <key>'")
            key = policy.matching_key(token.strip().encode("latin-1"))
            if key is None:
                return _unauthorized("Authorization: incorrect API key provided")
            scope.setdefault("state", {})[KEY_STATE] = key_fingerprint(key)
        if not policy.docs and path in DOC_PATHS:
            return _error(404, f"no route {path}", None, "not_found", "not_found_error")
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return _error(400, "Content-Length: must be a non-negative integer", "Content-Length",
                              "invalid_content_length")
            if int(length) > policy.max_body_bytes:
                return _error(413, f"the request body ({int(length)} bytes) exceeds the limit of "
                                   f"{policy.max_body_bytes} bytes", "body", "request_too_large")
        return None

    @staticmethod
    async def _buffer(scope, receive, limit: int):
        """Read the whole body (raising :class:`BodyTooLarge` past ``limit``); a ``receive`` replaying it."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                first = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
            more = message.get("more_body", False)
        else:
            first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return first
            return await receive()

        return replay


def _error(status: int, message: str, param: str | None, code: str | None,
           type: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _unauthorized(message: str) -> JSONResponse:
    return _error(401, message, "Authorization", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
