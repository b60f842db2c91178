"""The logprobs a response reports: the decode loop's :class:`~taps_ray.spec.logprobs.TokenLogprobs`
paired with the tokens the response's text consumed, as per-token entries ``{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}], "text_offset"}`` (the chat
``ChatCompletionTokenLogprob`` plus the completions ``text_offset``;
:func:`~taps_ray.serving.protocol.chat_logprobs` / ``completion_logprobs`` shape them).

``token`` is the token decoded alone (special tokens by name, an incomplete UTF-8 character as U+FFFD),
``bytes`` its exact bytes (from the byte-level vocabulary when the tokenizer is byte-level, else the
UTF-8 of ``token``), ``text_offset`` the characters of the tokens before it in this completion.
"""

from __future__ import annotations

from functools import lru_cache

from taps_ray.spec.logprobs import TokenLogprobs


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte in a byte-level vocabulary -> the byte."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return {**{chr(b): b for b in shown}, **{chr(256 + i): b for i, b in enumerate(hidden)}}


class TokenPieces:
    """Token id -> (text, bytes) for one tokenizer, cached (a vocabulary's pieces never change)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        piece = self.cache.get(token)
        if piece is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = None
            if self.byte_level:
                name, decoder = self.tokenizer.convert_ids_to_tokens(token), byte_decoder()
                if isinstance(name, str) and all(c in decoder for c in name):
                    raw = [decoder[c] for c in name]
            piece = self.cache[token] = (text, raw if raw is not None else list(text.encode("utf-8")))
        return piece


class LogprobStream:
    """Pairs the logprob parts the decode loop commits (:meth:`add`, its ``on_logprobs``) with the token
    ids a response consumes, in order (:meth:`take`)."""

    def __init__(self, pieces: TokenPieces, top: int):
        self.pieces = pieces
        self.top = top
        self.parts: list[TokenLogprobs] = []
        self.offset = 0

    def add(self, part: TokenLogprobs) -> None:
        self.parts.append(part.cpu())

    def take(self, ids: list[int]) -> list[dict]:
        """The entries of the next ``len(ids)`` committed tokens, whose ids are ``ids``."""
        if not ids:
            return []
        joined = TokenLogprobs.cat(self.parts, self.top)
        if len(joined) < len(ids):
            raise RuntimeError(f"{len(ids)} tokens consumed but only {len(joined)} logprobs committed")
        used, rest = joined[:len(ids)], joined[len(ids):]
        self.parts = [rest] if len(rest) else []
        values, top_ids, top_values = used.logprobs.tolist(), used.top_ids.tolist(), used.top_logprobs.tolist()
        entries = []
        for token, value, alt_ids, alt_values in zip(ids, values, top_ids, top_values, strict=True):
            text, raw = self.pieces(token)
            top = []
            for alt, alt_value in zip(alt_ids, alt_values, strict=True):
                alt_text, alt_raw = self.pieces(alt)
                top.append({"token": alt_text, "logprob": alt_value, "bytes": alt_raw})
            entries.append({"token": text, "logprob": value, "bytes": raw, "top_logprobs": top,
                            "text_offset": self.offset})
            self.offset += len(text)
        return entries
