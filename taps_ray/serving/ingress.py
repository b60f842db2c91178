"""OpenAI-compatible FastAPI ingress: ``/v1/chat/completions``, ``/v1/completions`` (JSON or SSE),
``/v1/models``, ``/health`` and ``/metrics``.

Client errors are 4xx with an OpenAI error body naming the field. Before routing,
:class:`~taps_ray.serving.access.AccessGuard` checks the Host, the API key, the docs switch and the
body size; the ingress then validates the body, the model, the ``taps`` options and the server's
limits (:func:`~taps_ray.serving.protocol.check_limits`); the verifier checks the prompt's token
count against the context length before prefill (its first streamed event is ``start`` or ``error``,
so no HTTP status is committed before that).
"""

import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from taps_ray.config import SamplingConfig, ServeConfig
from taps_ray.serving import access, protocol
from taps_ray.serving import metrics as serving_metrics
from taps_ray.serving.metrics import ServingMetrics
from taps_ray.serving.plan import DecodeRequest, resolve_plan
from taps_ray.serving.protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body

log = logging.getLogger(__name__)

app = FastAPI(title="taps_ray", description="Task-aware speculative decoding, OpenAI-compatible")
app.add_middleware(access.AccessGuard)


def _failed(status: int) -> None:
    if (metrics := serving_metrics.current()) is not None:
        metrics.failed(status)


@app.exception_handler(RequestError)
async def _request_error(request: Request, err: RequestError) -> JSONResponse:
    _failed(err.status)
    return JSONResponse(err.body(), status_code=err.status)


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


def public_checkpoint(checkpoint: str | None) -> str | None:
    """What ``/v1/models`` shows of a drafter's checkpoint: ``release:NAME`` as is, None (untrained) as
    None, any folder as ``"local"`` (no filesystem paths)."""
    if checkpoint is None or checkpoint.startswith("release:"):
        return checkpoint
    return "local"


def sse_line(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@serve.ingress(app)
class Ingress:
    """Ray Serve deployment body of the HTTP API (see :mod:`taps_ray.serving.app`)."""

    def __init__(self, verifier, serve_cfg: dict, sampling: dict, model_name: str, aliases: list[str],
                 api_keys: list[str] | None = None):
        self.verifier = verifier
        self.cfg = ServeConfig(**serve_cfg)
        keys = access.resolve_api_keys(api_keys or ())
        access.configure(access.AccessPolicy.from_config(self.cfg, keys))
        if not keys:
            log.warning("no API keys configured (serve.api_keys, --api-key, %s): the endpoint is open to anyone "
                        "who can reach it", access.ENV_KEYS)
        self.sampling = SamplingConfig(**sampling).model_dump()
        self.model_name = model_name
        self.aliases = {model_name, *aliases}
        self.metrics = serving_metrics.register(ServingMetrics(model_name))
        self.created = protocol.now()

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._serve(body, body.chat(), "messages", chat=True)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._serve(body, body.prompt, "prompt", chat=False)

    @app.get("/v1/models")
    async def models(self):
        drafters = {name: ({"average_of": d.average_of, "alpha": d.alpha} if d.average_of else
                           {"checkpoint": public_checkpoint(d.checkpoint)}) for name, d in self.cfg.drafters.items()}
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "taps_ray",
            "taps": {"default_strategy": self.cfg.strategy, "drafters": drafters},
        }]}

    @app.get("/health")
    async def health(self):
        try:
            await asyncio.wait_for(self.verifier.info.remote(), timeout=5.0)
        except Exception as err:
            log.warning("health: the verifier did not answer: %r", err)
            return JSONResponse({"status": "unavailable", "detail": "the verifier did not answer"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self):
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def _serve(self, body, prompt, prompt_param: str, chat: bool):
        start = time.perf_counter()
        try:
            request = self._request(body, prompt, prompt_param)
            events = self.verifier.options(stream=True).generate.remote(request)
            first = await events.__anext__()
            if first["type"] == "error":
                raise RequestError(first["message"], first["param"], first["status"], first["error_type"],
                                   first["code"])
        except RequestError:
            raise
        except Exception as err:
            log.exception("request failed before decoding started")
            self.metrics.failed(503)
            return JSONResponse(error_body(f"the verifier is unavailable: {err}", "server_error"), status_code=503)
        if body.stream:
            return StreamingResponse(self._sse(events, body, request.rid, chat, start), media_type="text/event-stream")
        self.metrics.running.labels(self.model_name).inc()
        ttft, done = None, None
        try:
            async for event in events:
                if event["type"] == "delta" and ttft is None:
                    ttft = time.perf_counter() - start
                elif event["type"] == "error":
                    self.metrics.failed(event["status"])
                    return JSONResponse(error_body(event["message"], event["error_type"], event["param"],
                                                   event["code"]), status_code=event["status"])
                elif event["type"] == "done":
                    done = event
        except asyncio.CancelledError:
            events.cancel()
            raise
        except Exception as err:
            log.exception("request %s failed while decoding", request.rid)
            self.metrics.failed(500)
            return JSONResponse(error_body(f"decoding failed: {err}", "server_error"), status_code=500)
        finally:
            self.metrics.running.labels(self.model_name).dec()
        if done is None:
            self.metrics.failed(500)
            return JSONResponse(error_body("decoding ended without a result", "server_error"), status_code=500)
        latency = time.perf_counter() - start
        self.metrics.finished(done["finish_reason"], done["usage"], done["taps"], latency, ttft or latency)
        make = protocol.chat_response if chat else protocol.completion_response
        return make(request.rid, self.model_name, done["text"], done["finish_reason"], done["usage"], done["taps"])

    def _request(self, body, prompt, prompt_param: str) -> DecodeRequest:
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
        )

    async def _sse(self, events, body, rid: str, chat: bool, start: float):
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
                        yield sse_line(chunk(rid, self.model_name, created, content, include_usage=usage_chunks))
                    elif event["type"] == "error":
                        finished = True
                        self.metrics.failed(event["status"])
                        yield sse_line(error_body(event["message"], event["error_type"], event["param"],
                                                  event["code"]))
                        break
                    elif event["type"] == "done":
                        finished = True
                        latency = time.perf_counter() - start
                        self.metrics.finished(event["finish_reason"], event["usage"], event["taps"], latency,
                                              ttft if ttft is not None else latency)
                        content = {"content": event["delta"]} if chat else event["delta"]
                        yield sse_line(chunk(rid, self.model_name, created, content, event["finish_reason"],
                                             include_usage=usage_chunks, taps=event["taps"]))
                        if usage_chunks:
                            yield sse_line(chunk(rid, self.model_name, created, None, usage=event["usage"],
                                                 include_usage=True))
            except Exception as err:
                finished = True
                log.exception("request %s failed while streaming", rid)
                self.metrics.failed(500)
                yield sse_line(error_body(f"decoding failed: {err}", "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            self.metrics.running.labels(self.model_name).dec()
            if not finished:
                events.cancel()
