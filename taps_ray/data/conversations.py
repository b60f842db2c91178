"""Rows of any known layout mapped to chat conversations and cleaned (the rules of
:mod:`taps_ray.data.sources`).

A conversation is ``list[{"role": "system"|"user"|"assistant", "content": str}]``. A mapper turns one
row into a conversation; it raises :class:`UnknownLayout` for a row no layout fits (the source is
unusable) and :class:`MalformedRow` for a row to skip. :func:`normalise` applies a mapper to every
row, cleans the results and counts each rule (:data:`COUNT_KEYS`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from taps_ray.data.origins import SourceError

log = logging.getLogger(__name__)

Message = dict[str, str]
Conversation = list[Message]

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
COUNT_KEYS = ("read", "valid", "kept", "skipped_empty", "skipped_roleless", "skipped_order",
              "skipped_malformed", "empty_turns_dropped")
_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


def _turns(raw: Any) -> Conversation:
    if not isinstance(raw, list):
        raise MalformedRow(f"conversation is a {type(raw).__name__}, not a list")
    turns = []
    for turn in raw:
        if not isinstance(turn, Mapping):
            raise MalformedRow(f"turn is a {type(turn).__name__}, not a mapping")
        if "from" in turn:
            role, content = turn.get("from"), turn.get("value")
        else:
            role, content = turn.get("role"), turn.get("content")
        mapped = ROLE_ALIASES.get(str(role).lower())
        if mapped is None:
            raise MalformedRow(f"unknown role {role!r}")
        if not isinstance(content, str):
            raise MalformedRow(f"{role} turn content is {type(content).__name__}, not a string")
        turns.append({"role": mapped, "content": content})
    return turns


class MalformedRow(Exception):
    """A row to skip: a turn that is not a mapping, has non-string content or an unknown role."""


class UnknownLayout(Exception):
    """A row no known layout fits: the source is unusable."""


def _text(row: Mapping, key: str) -> str | None:
    value = row.get(key)
    return value if isinstance(value, str) else None


def row_to_conversation(row: Any) -> Conversation:
    """The mapper of every layout the package understands (see :mod:`taps_ray.data.sources`)."""
    if not isinstance(row, Mapping):
        raise UnknownLayout(f"row is a {type(row).__name__}, not an object")
    for key in ("conversations", "messages"):
        if key in row:
            return _turns(row[key])
    instruction = _text(row, "instruction")
    if instruction is not None:
        extra = _text(row, "input")
        prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        return _pair(prompt, _text(row, "output"))
    for prompt_key, response_key in (("question", "answer"), ("problem", "solution")):
        prompt = _text(row, prompt_key)
        if prompt is not None:
            return _pair(prompt, _text(row, response_key))
    prompt = _text(row, "prompt")
    if prompt is not None:
        return _pair(prompt, None)
    raise UnknownLayout(
        f"row has none of the known layouts (conversations, messages, instruction/output, "
        f"question/answer, problem/solution, prompt); its keys: {sorted(row)}"
    )


def _pair(prompt: str, response: str | None) -> Conversation:
    conversation = [{"role": "user", "content": prompt}]
    if response is not None:
        conversation.append({"role": "assistant", "content": response})
    return conversation


def required_fields(*keys: str) -> Callable[[Any], Conversation]:
    """A mapper of rows with these string fields: the first is the prompt, the second (if any) the response."""
    def mapper(row: Any) -> Conversation:
        if not isinstance(row, Mapping):
            raise UnknownLayout(f"row is a {type(row).__name__}, not an object")
        values = [_text(row, key) for key in keys]
        missing = [key for key, value in zip(keys, values) if value is None]
        if missing:
            raise UnknownLayout(f"row lacks string field(s) {missing}; its keys: {sorted(row)}")
        return _pair(values[0], values[1] if len(values) > 1 else None)

    return mapper


def strip_calculator_annotations(text: str) -> str:
    """Remove GSM8K calculator annotations: ``48/2 = <<48/2=24>>24`` becomes ``48/2 = 24``."""
    return _CALCULATOR_ANNOTATION.sub("", text)


def gsm8k_row(row: Any) -> Conversation:
    """A GSM8K ``question``/``answer`` row, its calculator annotations removed."""
    conversation = required_fields("question", "answer")(row)
    conversation[1]["content"] = strip_calculator_annotations(conversation[1]["content"])
    return conversation


@dataclass
class Normalised:
    """The cleaned conversations of one source, whether it is prompt-only, and the per-rule counts."""

    conversations: list[Conversation]
    prompt_only: bool
    counts: dict[str, int]
    truncated_at_line: int | None = None


def normalise(
    rows: Iterable[tuple[str, Any]],
    mapper: Callable[[Any], Conversation],
    prompt_only: bool | None,
    origin: str,
) -> Normalised:
    """Map and clean ``(location, row)`` pairs. ``prompt_only=None`` derives it from the data."""
    counts = dict.fromkeys(COUNT_KEYS, 0)
    mapped: list[Conversation] = []
    malformed_examples: list[str] = []
    for location, row in rows:
        counts["read"] += 1
        try:
            conversation = mapper(row)
        except UnknownLayout as err:
            raise SourceError(f"{location}: {err}") from None
        except MalformedRow as err:
            counts["skipped_malformed"] += 1
            if len(malformed_examples) < 3:
                malformed_examples.append(f"{location}: {err}")
            continue
        kept_turns = [turn for turn in conversation if turn["content"].strip()]
        counts["empty_turns_dropped"] += len(conversation) - len(kept_turns)
        mapped.append(kept_turns)
    if malformed_examples:
        log.warning("%s: skipped %d malformed conversation(s), e.g. %s", origin,
                    counts["skipped_malformed"], "; ".join(malformed_examples))
    if prompt_only is None:
        prompt_only = not any(turn["role"] == "assistant" for conv in mapped for turn in conv)
        if prompt_only and mapped:
            log.info("%s: no row has a response; treating the source as prompt-only", origin)
    conversations = []
    for conversation in mapped:
        roles = [turn["role"] for turn in conversation]
        if not roles:
            counts["skipped_empty"] += 1
        elif "user" not in roles or (not prompt_only and "assistant" not in roles):
            counts["skipped_roleless"] += 1
        elif next(role for role in roles if role != "system") != "user":
            counts["skipped_order"] += 1
        else:
            conversations.append(conversation)
    counts["valid"] = len(conversations)
    return Normalised(conversations, prompt_only, counts)
