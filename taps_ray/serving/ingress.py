"""OpenAI-compatible FastAPI ingress: ``/v1/chat/completions``, ``/v1/completions`` (JSON or SSE),
``/v1/models``, ``/health`` (liveness), ``/ready`` (readiness) and ``/metrics``.

Client errors are 4xx with an OpenAI error body naming the field. Before routing,
:class:`~taps_ray.serving.errors.RequestContext` gives the request its id and arrival time and
:class:`~taps_ray.serving.access.AccessGuard` checks the Host, the API key, the docs switch and the
body size; the ingress then validates the body, the model, the ``taps`` options and the server's
limits (:func:`~taps_ray.serving.protocol.check_limits`); the verifier checks the prompt's token
count against the context length before prefill (its first streamed event is ``start`` or ``error``,
so no HTTP status is committed before that).

Load shedding: an ingress replica passes at most every verifier slot plus
``serve.admission.max_queued_requests`` requests on to the verifiers (:class:`~taps_ray.serving.admission.Admission`);
a request beyond them is answered at once with a 429 and ``Retry-After``. A request's ``serve.limits.request_timeout_s`` counts from its arrival, queueing
included (504 when it runs out before decoding starts). ``/health`` answers from the ingress alone;
``/ready`` asks the Serve controller whether the verifier and drafters have running replicas.
``/v1/models`` and ``/metrics`` (``taps_drafter_version``) show the drafter version each drafter's replicas
serve, asked of the replicas (at most every :data:`DRAFTERS_CACHE_S`), so a promotion
(:mod:`taps_ray.adapt.promote`) shows there as soon as it is done.

Exposure fails closed here too, whatever deployed the application (``taps serve``, ``serve deploy``, a
RayService): an ingress without API keys starts only when the address Serve's HTTP proxies bind (the Serve
controller's, else ``serve.http.host``) is loopback or ``serve.http.allow_unauthenticated`` is set, and warns either way.

Errors leak nothing: every error body carries the request id; 5xx bodies say only that something
failed, and the details (exception, traceback) go to the server log under that id.
"""

import asyncio
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from taps_ray.config import SamplingConfig, ServeConfig
from taps_ray.runtime import ray_compat
from taps_ray.serving import access, errors, protocol, status
from taps_ray.serving import metrics as serving_metrics
from taps_ray.serving.admission import Admission, VerifierStream, cancel_call
from taps_ray.serving.metrics import ServingMetrics
from taps_ray.serving.plan import DecodeRequest, drafter_deployment_name, resolve_plan
from taps_ray.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    error_body,
    internal_error_body,
    withhold_acceptance,
)

log = logging.getLogger(__name__)

app = FastAPI(title="taps_ray", description="Task-aware speculative decoding, OpenAI-compatible")
app.add_middleware(access.AccessGuard)
app.add_middleware(errors.RequestContext)
READY_CACHE_S = 1.0
"""How long ``/ready`` reuses the controller's answer (probes from many balancers cost one call)."""
READY_TIMEOUT_S = 10.0
"""How long ``/ready`` waits for the controller before it says ``not_ready``."""
DRAFTERS_CACHE_S = 2.0
"""How long ``/v1/models`` and ``/metrics`` reuse the drafter replicas' versions."""


def _failed(status: int) -> None:
    if (metrics := serving_metrics.current()) is not None:
        metrics.failed(status)


@app.exception_handler(RequestError)
async def _request_error(request: Request, err: RequestError) -> JSONResponse:
    _failed(err.status)
    return JSONResponse(err.body(), status_code=err.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    path = request.url.path[:200]
    if err.status_code == 404:
        message, type, code = f"no route {path}", "not_found_error", "not_found"
    elif err.status_code == 405:
        message, type, code = f"{request.method} is not allowed on {path}", "invalid_request_error", "method_not_allowed"
    else:
        message = err.detail if isinstance(err.detail, str) else "the request was refused"
        type, code = "invalid_request_error", None
    _failed(err.status_code)
    return JSONResponse(error_body(message, type, None, code), status_code=err.status_code, headers=err.headers)


def _union_tag(part) -> bool:
    """Whether a pydantic error-location part names a union member (``str``, ``list[int]``,
    ``function-after[...]``) rather than a field or an index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
    if first.get("type") == "json_invalid":
        message, param = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})", None
    elif not loc:
        message, param = f"the request body must be a JSON object: {first['msg']}", None
    else:
        param = ".".join(loc)
        message = f"{param}: {first['msg'].removeprefix('Value error, ')}"
    _failed(400)
    return JSONResponse(error_body(message, param=param), status_code=400)


def sse_line(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def per_key_limit(cfg: ServeConfig, keys: int, capacity: int) -> int | None:
    """Requests one API key may hold in an ingress replica: ``serve.admission.max_requests_per_key``, or by default,
    with several keys, every admitted slot but one (so no key holds them all); None with fewer than two
    keys and no setting."""
    if cfg.admission.max_requests_per_key is not None:
        return cfg.admission.max_requests_per_key
    return max(1, capacity - 1) if keys > 1 else None


def served_host() -> str | None:
    """The address Serve's HTTP proxies bind, asked of the Serve controller off the event loop
    (:func:`~taps_ray.runtime.ray_compat.serve_http_host`); None without a controller (an ingress built in-process)."""
    with ThreadPoolExecutor(1, thread_name_prefix="taps-serve-host") as pool:
        return pool.submit(ray_compat.serve_http_host).result()


@serve.ingress(app)
class Ingress:
    """Ray Serve deployment body of the HTTP API (see :mod:`taps_ray.serving.app`)."""

    def __init__(self, verifier, serve_cfg: dict, sampling: dict, model_name: str, aliases: list[str],
                 api_keys: list[str] | None = None):
        self.verifier = verifier
        self.cfg = ServeConfig(**serve_cfg)
        keys = access.resolve_api_keys(api_keys or ())
        if not keys:
            host = served_host() or self.cfg.http.host
            if refusal := access.exposure_refusal(host, keys, self.cfg.http.allow_unauthenticated):
                raise ValueError(refusal)
            log.warning(access.open_warning(host))
        access.configure(access.AccessPolicy.from_config(self.cfg, keys))
        self.keyed = bool(keys)
        self.sampling = SamplingConfig(**sampling).model_dump()
        self.model_name = model_name
        self.aliases = {model_name, *aliases}
        self.metrics = serving_metrics.register(ServingMetrics(model_name, self.cfg.http.metrics_names))
        self.created = protocol.now()
        self._ready = status.SharedFill(READY_CACHE_S)
        self._drafters = status.SharedFill(DRAFTERS_CACHE_S)
        self._controller = None
        self._cost_asked = -math.inf
        self._retry_after = {"Retry-After": str(max(1, math.ceil(self.cfg.admission.retry_after_s)))}
        capacity = self.cfg.verifier.num_replicas * self.cfg.admission.max_concurrent_requests + self.cfg.admission.max_queued_requests
        self.admission = Admission(capacity, per_key_limit(self.cfg, len(keys), capacity))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, http: Request):
        return await self._serve(http, body, body.chat(), "messages", chat=True)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, http: Request):
        return await self._serve(http, body, body.prompt, "prompt", chat=False)

    @app.get("/v1/models")
    async def models(self):
        serving = await self.drafter_replicas()
        drafters = {name: ({"average_of": d.average_of, "alpha": d.alpha} if d.average_of else
                           {"checkpoint": status.public_checkpoint(d.checkpoint)}) for name, d in self.cfg.drafters.items()}
        for name, stats in serving.items():
            drafters[name].update(status.served_versions(stats))
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "taps_ray",
            "taps": {"default_strategy": self.cfg.strategy, "drafters": drafters,
                     "cost_model": await self.cost_model()},
        }]}

    async def cost_model(self) -> dict | None:
        """The verifier's cost model: as the last finished request reported it, else asked once of the
        verifier at most every :data:`DRAFTERS_CACHE_S` (None when it does not answer within
        :data:`READY_TIMEOUT_S` or trees are fixed)."""
        now = time.monotonic()
        if self.metrics.cost_model is None and now - self._cost_asked > DRAFTERS_CACHE_S:
            self._cost_asked = now
            try:
                info = await asyncio.wait_for(self.verifier.info.remote(), READY_TIMEOUT_S)
            except Exception as err:
                log.info("no cost model from the verifier: %r", err)
                return None
            if info.get("cost_model"):
                self.metrics.record_cost(info["cost_model"])
        return self.metrics.cost_model

    @app.get("/health")
    async def health(self):
        """Liveness: this ingress answers. It asks no other deployment, so a busy verifier is not unhealthy."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self, http: Request):
        """Readiness: whether the verifier and each drafter have a running replica (from the Serve
        controller, not through their request queues). 503 without a verifier; ``degraded`` (200) when
        a drafter is down, since the verifier then decodes without it and the output is unchanged. With API
        keys set, a probe without a key gets the status alone; the per-component report needs a key."""
        report = await self._ready.get(self._readiness)
        if self.keyed and access.request_key(http.scope) is None:
            report = {"status": report["status"]}
        if report["status"] == "not_ready":
            return JSONResponse(report, status_code=503, headers=self._retry_after)
        return report

    async def _readiness(self) -> dict:
        try:
            running = await asyncio.wait_for(self.running_replicas(), READY_TIMEOUT_S)
        except Exception:
            log.exception("ready: the Serve controller did not answer")
            self._controller, running = None, {}
        return status.readiness(running, list(self.cfg.drafters))

    async def running_replicas(self) -> dict[str, int]:
        """Deployment name -> running replicas of this application, asked of the Serve controller
        without blocking this replica's event loop."""
        if self._controller is None:
            self._controller = await asyncio.to_thread(ray_compat.serve_controller)
        details = await self._controller.get_serve_instance_details.remote()
        app_name = getattr(serve.get_replica_context(), "app_name", None) or self.cfg.app_name
        application = (details.get("applications") or {}).get(app_name) or {}
        return {name: sum(getattr(r["state"], "value", r["state"]) == "RUNNING" for r in d.get("replicas", ()))
                for name, d in (application.get("deployments") or {}).items()}

    async def drafter_replicas(self) -> dict[str, list[dict]]:
        """Drafter name -> its replicas' ``stats`` (``[]`` for a drafter that does not answer within
        :data:`READY_TIMEOUT_S`); reused for :data:`DRAFTERS_CACHE_S`, one fill at a time."""
        return await self._drafters.get(self._ask_drafters)

    async def _ask_drafters(self) -> dict[str, list[dict]]:
        app_name = getattr(serve.get_replica_context(), "app_name", None) or self.cfg.app_name
        names = list(self.cfg.drafters)
        replies = dict(zip(names, await asyncio.gather(*(self._drafter_stats(app_name, n) for n in names))))
        self.metrics.serving_versions({n: status.version_counts(stats) for n, stats in replies.items()})
        return replies

    async def _drafter_stats(self, app_name: str, name: str) -> list[dict]:
        try:
            handle = serve.get_deployment_handle(drafter_deployment_name(name), app_name)
            return await handle.broadcast("stats").results_async(timeout_s=READY_TIMEOUT_S)
        except Exception as err:
            log.warning("drafter %s: no stats from its replicas: %r", name, err)
            return []

    @app.get("/metrics")
    async def metrics(self):
        await self.drafter_replicas()
        await self.cost_model()
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def _serve(self, http: Request, body, prompt, prompt_param: str, chat: bool):
        start = time.perf_counter()
        request = self._request(body, prompt, prompt_param, errors.request_id(http.scope), errors.arrival(http.scope))
        key = access.request_key(http.scope)
        release = self.admission.admit(key)
        if release == "key":
            self.metrics.key_refusals.labels(self.model_name, key).inc()
            return self._busy(request, f"key {key} holds {self.admission.per_key} slots",
                              f"this API key already has {self.admission.per_key} requests in progress, its share "
                              f"of this server")
        if release == "capacity":
            return self._busy(request, f"ingress admission full ({self.admission.capacity})")
        try:
            events = self.verifier.options(stream=True).generate.remote(request)
            refused = await self._first_event(events, request)
            if refused is not None:
                return refused
            if body.stream:
                started = asyncio.Event()
                response = VerifierStream(self._sse(events, body, request, chat, start, started), events, release,
                                          started.is_set)
                release = None
                return response
            return await self._complete(events, request, chat, start)
        finally:
            if release is not None:
                release()

    async def _complete(self, events, request: DecodeRequest, chat: bool, start: float):
        """The whole (non-streamed) answer of a request whose decoding has started."""
        self.metrics.running.labels(self.model_name).inc()
        ttft, done, finished = None, None, False
        logprobs = None if request.logprobs is None else []
        try:
            async for event in events:
                if logprobs is not None and event["type"] in ("delta", "done"):
                    logprobs += event.get("logprobs") or []
                if event["type"] == "delta" and ttft is None:
                    ttft = time.perf_counter() - start
                elif event["type"] == "error":
                    finished = True
                    return self._error_event(event, request)
                elif event["type"] == "done":
                    done = event
            finished = True
        except asyncio.CancelledError:
            self.metrics.aborted.labels(self.model_name, "disconnect").inc()
            raise
        except Exception:
            finished = True
            log.exception("request %s (%s) failed while decoding", request.request_id, request.rid)
            self.metrics.failed(500)
            return JSONResponse(internal_error_body(request_id=request.request_id), status_code=500)
        finally:
            self.metrics.running.labels(self.model_name).dec()
            if not finished:
                cancel_call(events)
        if done is None:
            log.error("request %s (%s): the verifier's stream ended without a result", request.request_id, request.rid)
            self.metrics.failed(500)
            return JSONResponse(internal_error_body(request_id=request.request_id), status_code=500)
        latency = time.perf_counter() - start
        self.metrics.finished(done["finish_reason"], done["usage"], done["taps"], latency, ttft or latency)
        make = protocol.chat_response if chat else protocol.completion_response
        return make(request.rid, self.model_name, done["text"], done["finish_reason"], done["usage"],
                    self._client_taps(done["taps"]), logprobs)

    def _client_taps(self, taps: dict) -> dict:
        """The response's ``taps`` block as the client sees it: without the per-step acceptance figures
        unless :meth:`~taps_ray.config.ServeConfig.shows_acceptance` (metrics always count them)."""
        return taps if self.cfg.shows_acceptance(bool(taps.get("adapted"))) else withhold_acceptance(taps)

    def _busy(self, request: DecodeRequest, why: str,
              told: str = "the server is at capacity (every decoding slot is busy and its queue is full)") -> JSONResponse:
        """The at-once 429 (``server_busy``, ``Retry-After``) of a request refused for load; ``why`` goes to the
        log, ``told`` to the client."""
        log.info("request %s shed: %s", request.request_id, why)
        self.metrics.failed(429)
        return JSONResponse(error_body(
            f"{told}; retry after {self._retry_after['Retry-After']} s", "rate_limit_error", None,
            "server_busy", request.request_id), status_code=429, headers=self._retry_after)

    async def _first_event(self, events, request: DecodeRequest) -> JSONResponse | None:
        """Wait (until the request's deadline) for the verifier's first event: None when decoding started,
        the response otherwise: 429 at once when the verifier's queue is full, 504 when the deadline passed
        in the queue, 503 when the verifier cannot be reached, the verifier's own 4xx. Cancelled (the
        client hung up) or refused, the request leaves the queue before any prefill."""
        waiting = self.metrics.waiting.labels(self.model_name)
        waiting.inc()
        try:
            first = await asyncio.wait_for(events.__anext__(), max(request.expires_at - time.time(), 0.0))
        except BackPressureError as err:
            cancel_call(events)
            return self._busy(request, repr(err))
        except TimeoutError:
            cancel_call(events)
            self.metrics.aborted.labels(self.model_name, "timeout").inc()
            self.metrics.failed(504)
            return JSONResponse(error_body(
                f"the request timed out after {self.cfg.limits.request_timeout_s:g} s waiting for a decoding slot",
                "timeout_error", None, "timeout", request.request_id), status_code=504)
        except asyncio.CancelledError:
            cancel_call(events)
            self.metrics.aborted.labels(self.model_name, "disconnect").inc()
            raise
        except Exception:
            cancel_call(events)
            log.exception("request %s (%s): the verifier could not be reached", request.request_id, request.rid)
            self.metrics.failed(503)
            return JSONResponse(internal_error_body("The model is not available right now", "unavailable",
                                                    request.request_id), status_code=503, headers=self._retry_after)
        finally:
            waiting.dec()
        if first["type"] == "error":
            return self._error_event(first, request)
        return None

    def _error_event(self, event: dict, request: DecodeRequest) -> JSONResponse:
        self.metrics.failed(event["status"])
        return JSONResponse(self._error_body(event, request), status_code=event["status"])

    @staticmethod
    def _error_body(event: dict, request: DecodeRequest) -> dict:
        """The client's body for a verifier error event: the verifier's message for client errors and
        timeouts, a generic one (its details are in the verifier's log) for internal errors."""
        if event["status"] >= 500 and event["status"] != 504:
            return internal_error_body(request_id=request.request_id)
        return RequestError(event["message"], event["param"], event["status"], event["error_type"],
                            event["code"]).body(request.request_id)

    def _request(self, body, prompt, prompt_param: str, request_id: str, arrival: float) -> DecodeRequest:
        protocol.check_limits(body, self.cfg)
        if body.model not in self.aliases:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                               "model", status=404, type="not_found_error", code="model_not_found")
        taps = body.taps
        plan = resolve_plan(taps.strategy if taps else None, taps.drafters if taps else None, self.cfg)
        return DecodeRequest(
            rid=protocol.new_id("chatcmpl" if prompt_param == "messages" else "cmpl"), prompt=prompt, plan=plan,
            max_tokens=body.max_tokens, sampling=body.sampling(self.sampling), stop=body.stop,
            raw=prompt_param == "prompt", prompt_param=prompt_param,
            deadline_s=taps.draft_deadline_s if taps else None,
            request_id=request_id, expires_at=arrival + self.cfg.limits.request_timeout_s, logprobs=body.top_logprobs_count,
            store=getattr(body, "store", None) is True,
        )

    async def _sse(self, events, body, request: DecodeRequest, chat: bool, start: float, started: asyncio.Event):
        started.set()
        rid = request.rid
        created = protocol.now()
        usage_chunks = body.include_usage
        chunk = protocol.chat_chunk if chat else protocol.completion_chunk
        ttft, finished = None, False
        self.metrics.running.labels(self.model_name).inc()
        try:
            try:
                if chat:
                    yield sse_line(chunk(rid, self.model_name, created, {"role": "assistant", "content": ""},
                                         include_usage=usage_chunks))
                async for event in events:
                    if event["type"] == "delta":
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        content = {"content": event["text"]} if chat else event["text"]
                        yield sse_line(chunk(rid, self.model_name, created, content, include_usage=usage_chunks,
                                             logprobs=event.get("logprobs")))
                    elif event["type"] == "error":
                        finished = True
                        self.metrics.failed(event["status"])
                        yield sse_line(self._error_body(event, request))
                        break
                    elif event["type"] == "done":
                        finished = True
                        latency = time.perf_counter() - start
                        self.metrics.finished(event["finish_reason"], event["usage"], event["taps"], latency,
                                              ttft if ttft is not None else latency)
                        content = {"content": event["delta"]} if chat else event["delta"]
                        yield sse_line(chunk(rid, self.model_name, created, content, event["finish_reason"],
                                             include_usage=usage_chunks, taps=self._client_taps(event["taps"]),
                                             logprobs=event.get("logprobs")))
                        if usage_chunks:
                            yield sse_line(chunk(rid, self.model_name, created, None, usage=event["usage"],
                                                 include_usage=True))
                if not finished:
                    finished = True
                    log.error("request %s (%s): the verifier's stream ended without a result", request.request_id,
                              rid)
                    self.metrics.failed(500)
                    yield sse_line(internal_error_body(request_id=request.request_id))
            except Exception:
                finished = True
                log.exception("request %s (%s) failed while streaming", request.request_id, rid)
                self.metrics.failed(500)
                yield sse_line(internal_error_body(request_id=request.request_id))
            yield "data: [DONE]\n\n"
        finally:
            self.metrics.running.labels(self.model_name).dec()
            if not finished:
                self.metrics.aborted.labels(self.model_name, "disconnect").inc()
                cancel_call(events)

