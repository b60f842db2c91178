"""OpenAI-compatible request and response models, the ``taps`` extension and error bodies.

Requests follow the OpenAI Chat Completions / Completions bodies (unknown keys are ignored, as
vLLM does); parameters that would change the output but are not supported (``n > 1``,
``logprobs``, penalties, ``echo``) are rejected with a 400 naming them, never silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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

    def body(self) -> dict:
        named = self.param is None or self.message.startswith(self.param)
        return error_body(self.message if named else f"{self.param}: {self.message}", self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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

    strategy: str | None = None
    drafters: list[str] | None = Field(default=None, min_length=1)
    draft_deadline_s: float | None = Field(default=None, ge=0)


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """Parameters shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    taps: TapsOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        if stops is not None and len(stops) > 8:
            raise ValueError(f"at most 8 stop sequences, got {len(stops)}")
        return stops or None

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n=1 is supported, got {value}")
        return value

    @field_validator("logprobs", "presence_penalty", "frequency_penalty")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if value not in (None, False, 0, 0.0):
            raise ValueError(f"{info.field_name} is not supported (got {value!r})")
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


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _completion_tokens(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: the last message must not be from the assistant (continuing a reply "
                             "is not supported)")
        return self

    def chat(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _unsupported_here(cls, value: Any, info) -> Any:
        allowed = {"echo": (False,), "best_of": (None, 1), "suffix": (None, "")}[info.field_name]
        if value is True or value not in allowed:
            raise ValueError(f"{info.field_name} is not supported (got {value!r})")
        return value

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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def chat_response(rid: str, model: str, text: str, finish: str, usage: dict, taps: dict) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish}],
        "usage": usage, "taps": taps,
    }


def completion_response(rid: str, model: str, text: str, finish: str, usage: dict, taps: dict) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": usage, "taps": taps,
    }


def _stream_chunk(rid: str, model: str, created: int, obj: str, choice: dict | None, usage: dict | None,
                  include_usage: bool, taps: dict | None) -> dict:
    chunk = {"id": rid, "object": obj, "created": created, "model": model,
             "choices": [] if choice is None else [{"index": 0, **choice, "logprobs": None}]}
    if include_usage:
        chunk["usage"] = usage
    if taps is not None:
        chunk["taps"] = taps
    return chunk


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish: str | None = None,
               usage: dict | None = None, include_usage: bool = False, taps: dict | None = None) -> dict:
    choice = None if delta is None else {"delta": delta, "finish_reason": finish}
    return _stream_chunk(rid, model, created, "chat.completion.chunk", choice, usage, include_usage, taps)


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish: str | None = None,
                     usage: dict | None = None, include_usage: bool = False, taps: dict | None = None) -> dict:
    choice = None if text is None else {"text": text, "finish_reason": finish}
    return _stream_chunk(rid, model, created, "text_completion", choice, usage, include_usage, taps)
