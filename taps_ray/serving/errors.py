"""Every HTTP request's id and arrival time, and the last line of defence against leaking internals.

:class:`RequestContext` is the outermost ASGI middleware of the ingress: it gives each request an id
(the ``X-Request-ID`` that Ray Serve's proxy set or passed on and returns in the response headers, when
it is a plain token; a fresh one otherwise), records its arrival time (deadlines count from it) and
catches any exception that escapes the routes: the traceback goes to the server log under the request
id, the client gets a 500 whose OpenAI-shaped body has a generic message and that id, nothing else.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from ray.exceptions import TaskCancelledError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from taps_ray.serving.protocol import REQUEST_ID, internal_error_body

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_PLAIN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def request_id_from(headers: Headers) -> str:
    """The request's ``X-Request-ID`` when it is a plain token (letters, digits, ``._:-``, at most 128
    characters, so it cannot forge log lines), else a fresh one."""
    given = headers.get(REQUEST_ID_HEADER, "")
    return given if _PLAIN_ID.fullmatch(given) else uuid.uuid4().hex


def request_id(scope) -> str:
    return scope.get("state", {}).get("request_id") or REQUEST_ID.get() or "unknown"


def arrival(scope) -> float:
    """The wall-clock time (``time.time()``) the request reached the ingress."""
    return scope.get("state", {}).get("arrival") or time.time()


class RequestContext:
    """ASGI middleware: request id and arrival time into ``scope["state"]`` and :data:`REQUEST_ID`, and a
    generic 500 (details logged) for anything a route lets escape."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_from(Headers(scope=scope))
        state = scope.setdefault("state", {})
        state["request_id"], state["arrival"] = rid, time.time()
        token = REQUEST_ID.set(rid)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except TaskCancelledError:
            raise  # the client hung up and Serve cancelled the request: Serve's business, not an error
        except Exception:
            log.exception("request %s (%s %s) failed with an unhandled error", rid, scope.get("method"),
                          scope.get("path"))
            if not started:
                await JSONResponse(internal_error_body(request_id=rid), status_code=500)(scope, receive, send)
        finally:
            REQUEST_ID.reset(token)
