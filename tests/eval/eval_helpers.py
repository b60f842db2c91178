"""A tiny target with a stand-in chat tokenizer, so the evaluation runner's one prompt path (the chat
template over the conversation's texts) runs in unit tests without a real tokenizer.

:class:`IdTextTokenizer`: a user turn is ``2`` then ``2 + byte % (V - 2)`` per byte of its first 48
bytes; an answer's text is its token ids written as ``<id>`` marks, which the template reads back, so
a second turn's prompt holds the first answer's token ids exactly.
"""

from __future__ import annotations

import re

from taps_ray.models.target import TargetModel
from tests.spec.spec_helpers import peaky_tiny_target

_MARK = re.compile(r"<(\d+)>")


class IdTextTokenizer:
    """The tokenizer calls :mod:`taps_ray` makes on a target (``apply_chat_template``, ``decode``)."""

    eos_token_id = 1

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True,
                            return_dict: bool = False) -> list[int]:
        ids: list[int] = []
        for message in messages:
            if message["role"] == "assistant":
                ids += [int(i) for i in _MARK.findall(message["content"])]
            else:
                ids += [2] + [2 + b % (self.vocab_size - 2) for b in message["content"].encode()[:48]]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def chat_tiny_target(seed: int = 0) -> TargetModel:
    """:func:`peaky_tiny_target` with an :class:`IdTextTokenizer`."""
    target = peaky_tiny_target(seed)
    target.tokenizer = IdTextTokenizer(target.vocab_size)
    return target
