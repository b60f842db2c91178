"""What the decode loop commits, as it commits it, and how a request ends early: incremental detokenization
with stop sequences (:class:`TextStream`, one per request that has stop sequences or a step observer), the
:class:`StepObserver` protocol, and the cancellation and deadline check (:func:`interrupted`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol


class TextStream:
    """Incremental detokenization with stop sequences.

    :meth:`push` takes committed token ids and returns the text that is safe to send: it holds back
    a tail that may still grow into a stop sequence and an incomplete character at the end. After
    a stop sequence, ``hit`` is set, the text ends before it and ``used`` counts the tokens consumed.
    A push decodes once; only a push whose text holds a stop sequence decodes token by token to find the
    token that completes it.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.window = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.hit = False

    @property
    def used(self) -> int:
        return len(self.ids)

    def _decode(self, ids: list[int] | None = None) -> str:
        return self.tokenizer.decode(self.ids if ids is None else ids, skip_special_tokens=True)

    def _first_stop(self, text: str) -> int | None:
        """Where the first stop sequence begins in ``text`` (searched from where the last text could have
        begun one), or None."""
        start = max(0, len(self.text) - self.window)
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _pending_stop(self) -> int:
        """Length of the longest tail of the text that begins a stop sequence."""
        for k in range(min(self.window, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stop):
                return k
        return 0

    def push(self, ids: list[int]) -> str:
        if self.hit or not ids:
            return ""
        text = self._decode(self.ids + ids)
        if not self.stop or self._first_stop(text) is None:
            self.ids += ids
            self.text = text
        else:  # a stop sequence is in there: find the token that completes it, one at a time
            for token in ids:
                self.ids.append(token)
                text = self._decode()
                if (at := self._first_stop(text)) is not None:
                    self.text, self.hit = text[:at], True
                    break
                self.text = text
        safe = len(self.text) if self.hit else len(self.text) - self._pending_stop()
        while not self.hit and safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:safe], safe
        return delta

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta


class StepObserver(Protocol):
    """Sees what the decode loop commits, as it commits it, and may end the loop.

    ``on_step`` gets the token ids committed since its last call (the first token after the prefill, then
    each step's kept tokens, cut after the token that completes a stop sequence) and the text they made
    safe to send (:class:`~taps_ray.spec.text.TextStream`: held back while it may still grow into a stop
    sequence or is an incomplete character); it returns a finish reason to end the loop after them, or None.
    """

    def on_step(self, tokens: list[int], text: str) -> str | None: ...


class Cancel(Protocol):
    """A cancellation flag (``threading.Event`` is one)."""

    def is_set(self) -> bool: ...


def text_stream(tokenizer, stop: Sequence[str] | None, observer: StepObserver | None) -> TextStream | None:
    """A request's text stream: one when it has stop sequences or an observer (and there is a ``tokenizer``);
    ValueError for stop sequences that are not a list of non-empty strings, or without a tokenizer."""
    if stop is not None and (isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    if stop and tokenizer is None:
        raise ValueError("stop sequences need the target's tokenizer; this target has none")
    if tokenizer is None or not (stop or observer is not None):
        return None
    return TextStream(tokenizer, list(stop or []))


def interrupted(cancel: Cancel | None, deadline: float | None) -> str | None:
    """``cancelled`` when ``cancel`` is set, ``timeout`` when ``deadline`` (``time.monotonic()``) has passed."""
    if cancel is not None and cancel.is_set():
        return "cancelled"
    if deadline is not None and time.monotonic() > deadline:
        return "timeout"
    return None


def observe(text: TextStream | None, observer: StepObserver | None, ids: list[int]) -> tuple[list[int], str | None]:
    """Hand committed token ``ids`` to ``text`` and ``observer``: (the ids kept, cut after the token that completes
    a stop sequence; the finish reason when the request ends here: ``stop``, or the observer's)."""
    delta = ""
    if text is not None:
        before = text.used
        delta = text.push(ids)
        if text.hit:
            ids = ids[:text.used - before]
    reason = observer.on_step(ids, delta) if observer is not None else None
    return ids, "stop" if text is not None and text.hit else reason
