"""OpenAI-compatible request and response models, the ``taps`` extension and error bodies.

Requests follow the OpenAI Chat Completions / Completions bodies (unknown keys are ignored, as
vLLM does). Every OpenAI field the server does not honour (:data:`CHAT_UNSUPPORTED`,
:data:`COMPLETION_UNSUPPORTED`: ``n > 1``, penalties, ``logit_bias``, tools and functions,
``response_format``, audio, ``prediction``, ``echo``, ...) is a 400 naming it unless it holds its
neutral value (null, or the value that asks for what the server does anyway: ``tool_choice: "none"``,
``response_format: {"type": "text"}``, ``modalities: ["text"]``, ...), never silently dropped; hints
that do not change the output (``user``, ``metadata``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ...) are ignored. ``logprobs`` / ``top_logprobs`` are served (the target's raw
log-probabilities, :mod:`taps_ray.spec.logprobs`): chat ``logprobs: true`` with ``top_logprobs`` 0..20,
completions ``logprobs`` 0..5.
Numbers must be finite and in range (``temperature`` 0 or in [0.01, 2], ``top_p`` in (0, 1],
``seed`` a signed 64-bit integer) and strings valid Unicode (no lone surrogates); the server's
size limits (:class:`~taps_ray.config.ServeConfig`) are applied by :func:`check_limits`.
"""

from __future__ import annotations

import time
import uuid
from contextvars import ContextVar
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from taps_ray.config import ServeConfig

CHAT_UNSUPPORTED: dict[str, tuple] = {
    "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "verbosity": (None,), "web_search_options": (None,), "moderation": (None,),
}
"""Chat request fields the server does not honour -> the values it accepts for them (each means the
field's default behaviour); any other value is a 400 naming the field."""
COMPLETION_UNSUPPORTED: dict[str, tuple] = {
    "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
}
"""Completions request fields the server does not honour -> the values it accepts for them."""
MESSAGE_UNSUPPORTED: dict[str, tuple] = {"tool_calls": (None, []), "function_call": (None,), "audio": (None,)}
"""Chat message fields the server does not honour (an assistant turn's tool calls or audio)."""
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}
LOGPROB_FLOOR = -9999.0
"""What a log-probability below it (or -inf) is reported as (the OpenAI API's "very unlikely")."""
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
INT64 = (-(2 ** 63), 2 ** 63 - 1)


class RequestError(Exception):
    """A client error: HTTP ``status``, OpenAI error ``type``, the offending ``param`` and ``code``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self, request_id: str | None = None) -> dict:
        named = self.param is None or self.message.startswith(self.param)
        return error_body(self.message if named else f"{self.param}: {self.message}", self.type, self.param, self.code,
                          request_id)


REQUEST_ID: ContextVar[str | None] = ContextVar("taps_request_id", default=None)
"""The id of the HTTP request being answered (set by :class:`~taps_ray.serving.errors.RequestContext`)."""

INTERNAL_ERROR = "The server had an error while processing your request"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, request_id: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code", "request_id"}}``: the OpenAI API's error object plus
    the request's id (``request_id``, else the current one), under which the server log has the details."""
    return {"error": {"message": message, "type": type, "param": param, "code": code,
                      "request_id": request_id or REQUEST_ID.get()}}


def internal_error_body(message: str = INTERNAL_ERROR, code: str = "internal_error",
                        request_id: str | None = None) -> dict:
    """A 5xx body that says nothing about the cause (that goes to the server log under the request id)."""
    rid = request_id or REQUEST_ID.get()
    return error_body(f"{message}; the server log has the details under request id {rid}", "server_error", None,
                      code, rid)


def _unsupported(table: dict[str, tuple]):
    """A field validator refusing any value of the fields in ``table`` other than their neutral ones."""

    def check(cls, value: Any, info) -> Any:
        neutral = table[info.field_name]
        if not any(value is n or (n is not None and value == n and isinstance(value, bool) == isinstance(n, bool))
                   for n in neutral):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            accepted = " or ".join("null" if n is None else repr(n) for n in neutral)
            raise ValueError(f"not supported by this server (got {shown}); omit it or send {accepted}")
        return value

    return field_validator(*table)(classmethod(check))


def _unsupported_fields(name: str, table: dict[str, tuple]) -> type[BaseModel]:
    """A model declaring ``table``'s fields (any value, default null) and refusing all but their neutral values:
    a base of the request models, so each unsupported field is named once, in its table."""
    return create_model(name, __config__=ConfigDict(extra="ignore"),
                        __validators__={"check_unsupported": _unsupported(table)},
                        **{field: (Any, None) for field in table})


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"the string is not valid Unicode (a lone surrogate at character {err.start})") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]
"""A string that encodes as UTF-8 (JSON ``\\ud800`` escapes decode to lone surrogates, which do not)."""
Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class TapsOptions(_Body):
    """The ``taps`` extension (``extra_body={"taps": {...}}`` with the OpenAI client).

    ``strategy``: ``vanilla``, ``single``, ``averaged[:ALPHA]``, ``routed:confidence[:step|:request]``,
    ``routed:entropy[:step|:request]``, ``merged:union`` or ``merged:budget``; ``drafters``: the
    drafter names to compose (defaults from the server config); ``draft_deadline_s``: this request's
    per-step drafter deadline.
    """

    model_config = ConfigDict(extra="forbid")

    strategy: Text | None = None
    drafters: list[Text] | None = Field(default=None, min_length=1)
    draft_deadline_s: Finite | None = Field(default=None, ge=0)


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """Parameters shared by both endpoints."""

    model: Text
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-1, le=INT64[1])
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: Text | None = None
    taps: TapsOptions | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not (value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
            raise ValueError(f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], got {value!r}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"must be in (0, 1], got {value!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops or None

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n=1 is supported, got {value}")
        return value

    def sampling(self, defaults: dict) -> dict:
        """SamplingConfig keys: the request's values over the server's ``defaults``."""
        values = dict(defaults)
        for key in ("temperature", "top_p", "seed"):
            if getattr(self, key) is not None:
                values[key] = getattr(self, key)
        if self.top_k is not None:
            values["top_k"] = max(self.top_k, 0)
        return values

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token the response reports (None: no logprobs)."""
        raise NotImplementedError


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body, _unsupported_fields("MessageUnsupported", MESSAGE_UNSUPPORTED)):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation, _unsupported_fields("ChatUnsupported", CHAT_UNSUPPORTED)):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS["chat"])
    store: bool | None = None  # OpenAI's "keep this for distillation": with serve.capture on, what is captured

    @field_validator("messages")
    @classmethod
    def _last_message(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if value[-1].role == "assistant":
            raise ValueError("the last message must not be from the assistant (continuing a reply is not "
                             "supported)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError(f"{value} alternatives per token need logprobs: true")
        return value

    @model_validator(mode="after")
    def _completion_tokens(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Generation, _unsupported_fields("CompletionUnsupported", COMPLETION_UNSUPPORTED)):
    prompt: Text | list[int] | list[Text]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS["completions"], strict=True)

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError(f"one prompt per request (batched prompts are not supported), got {len(value)}")
            value = value[0]
        if isinstance(value, str) and not value:
            raise ValueError("prompt is empty")
        if isinstance(value, list) and not value:
            raise ValueError("prompt is empty")
        return value


def check_limits(body: ChatCompletionRequest | CompletionRequest, cfg: ServeConfig) -> None:
    """:class:`RequestError` (400, naming the field, the value and the limit) when ``body`` exceeds the
    server's limits: messages, prompt characters (token ids of a ``prompt`` given as ids), stop strings,
    ``max_tokens`` and ``taps.draft_deadline_s``."""
    limits = cfg.limits
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > limits.max_messages:
            raise RequestError(f"{len(body.messages)} messages; at most {limits.max_messages} are accepted", "messages",
                               code="too_many_messages")
        chars, param = sum(len(m.text()) + len(m.name or "") for m in body.messages), "messages"
    else:
        chars, param = (len(body.prompt) if isinstance(body.prompt, str) else 0), "prompt"
        if not isinstance(body.prompt, str) and len(body.prompt) > limits.max_prompt_tokens:
            raise RequestError(f"{len(body.prompt)} token ids; at most {limits.max_prompt_tokens} are accepted", "prompt",
                               code="prompt_too_long")
    if chars > limits.max_prompt_chars:
        raise RequestError(f"{chars} characters; at most {limits.max_prompt_chars} are accepted", param,
                           code="prompt_too_long")
    stops = body.stop or []
    if len(stops) > limits.max_stop_sequences:
        raise RequestError(f"{len(stops)} stop sequences; at most {limits.max_stop_sequences} are accepted", "stop")
    if (longest := max((len(s) for s in stops), default=0)) > limits.max_stop_chars:
        raise RequestError(f"a stop sequence of {longest} characters; at most {limits.max_stop_chars} per sequence",
                           "stop")
    if body.max_tokens is not None and body.max_tokens > limits.max_tokens_cap:
        name = "max_tokens"
        if getattr(body, "max_completion_tokens", None) == body.max_tokens:
            name = "max_completion_tokens"
        raise RequestError(f"{body.max_tokens} is more than this server's cap of {limits.max_tokens_cap} tokens", name)
    deadline = body.taps.draft_deadline_s if body.taps else None
    if deadline is not None and deadline > cfg.routing.draft_deadline_cap_s:
        raise RequestError(f"{deadline:g} s is more than this server's cap of {cfg.routing.draft_deadline_cap_s:g} s",
                           "taps.draft_deadline_s")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """The chat ``choices[].logprobs`` object from per-token ``entries`` (each ``{"token", "logprob",
    "bytes", "top_logprobs": [{"token", "logprob", "bytes"}], "text_offset"}``, as the verifier emits
    them); None when logprobs were not asked."""
    if entries is None:
        return None
    return {"content": [{"token": e["token"], "logprob": _logprob(e["logprob"]), "bytes": e["bytes"],
                         "top_logprobs": [{"token": t["token"], "logprob": _logprob(t["logprob"]),
                                           "bytes": t["bytes"]} for t in e["top_logprobs"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[dict] | None) -> dict | None:
    """The completions ``choices[].logprobs`` object (``tokens``, ``token_logprobs``, ``top_logprobs`` as
    ``{token: logprob}``, ``text_offset``) from the same ``entries``; None when logprobs were not asked."""
    if entries is None:
        return None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [_logprob(e["logprob"]) for e in entries],
            "top_logprobs": [{t["token"]: _logprob(t["logprob"]) for t in e["top_logprobs"]} for e in entries],
            "text_offset": [e["text_offset"] for e in entries]}


def chat_response(rid: str, model: str, text: str, finish: str, usage: dict, taps: dict,
                  logprobs: list[dict] | None = None) -> dict:
    """A ``chat.completion`` body; ``logprobs``: the per-token entries (:func:`chat_logprobs`) or None."""
    return {
        "id": rid, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": chat_logprobs(logprobs), "finish_reason": finish}],
        "usage": usage, "taps": taps,
    }


def completion_response(rid: str, model: str, text: str, finish: str, usage: dict, taps: dict,
                        logprobs: list[dict] | None = None) -> dict:
    """A ``text_completion`` body; ``logprobs``: the per-token entries (:func:`completion_logprobs`) or None."""
    return {
        "id": rid, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": completion_logprobs(logprobs), "finish_reason": finish}],
        "usage": usage, "taps": taps,
    }


def _stream_chunk(rid: str, model: str, created: int, obj: str, choice: dict | None, usage: dict | None,
                  include_usage: bool, taps: dict | None) -> dict:
    chunk = {"id": rid, "object": obj, "created": created, "model": model,
             "choices": [] if choice is None else [{"index": 0, **choice}]}
    if include_usage:
        chunk["usage"] = usage
    if taps is not None:
        chunk["taps"] = taps
    return chunk


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish: str | None = None,
               usage: dict | None = None, include_usage: bool = False, taps: dict | None = None,
               logprobs: list[dict] | None = None) -> dict:
    """A ``chat.completion.chunk``: one choice with ``delta`` (none, for the closing usage chunk, when
    ``delta`` is None); ``usage`` (null but on the last chunk) only with ``include_usage``."""
    choice = None if delta is None else {"delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
    return _stream_chunk(rid, model, created, "chat.completion.chunk", choice, usage, include_usage, taps)


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish: str | None = None,
                     usage: dict | None = None, include_usage: bool = False, taps: dict | None = None,
                     logprobs: list[dict] | None = None) -> dict:
    """A streamed ``text_completion``, as :func:`chat_chunk` (``finish_reason`` is null until the last text
    chunk, as the OpenAI API streams it, although the ``openai`` package's ``Completion`` type declares it
    non-null)."""
    choice = None if text is None else {"text": text, "logprobs": completion_logprobs(logprobs),
                                        "finish_reason": finish}
    return _stream_chunk(rid, model, created, "text_completion", choice, usage, include_usage, taps)


ACCEPTANCE_FIELDS = ("steps", "tau", "accept_lengths", "draft_tokens", "accepted_tokens", "drafted_steps",
                     "plain_steps", "shrunk_steps", "shed_draft_tokens", "route_decisions", "route_per_step",
                     "draft_s", "verify_s", "drafter_compute_s")
"""The ``taps`` fields that tell how well the drafters predicted this text (acceptance per step, and what
it can be read back from: step counts, routes, timings split by stage)."""


def withhold_acceptance(taps: dict) -> dict:
    """``taps`` without :data:`ACCEPTANCE_FIELDS`, marked ``"acceptance": "withheld"``: where drafters adapt
    to captured traffic, those figures would tell a client what the drafters learned from other users."""
    return {**{k: v for k, v in taps.items() if k not in ACCEPTANCE_FIELDS}, "acceptance": "withheld"}
