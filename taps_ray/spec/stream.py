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
    an incomplete character at the end and a tail before it that may still grow into a stop sequence. After
    a stop sequence, ``hit`` is set, the text ends before it and ``used`` counts the tokens consumed.
    ``text`` is the decode of ``ids`` as one call gives it whenever that ends on a complete character.

    A push decodes only a window of recent ids (:meth:`_extend`): the ids from a point where the text
    read complete (context for tokenizers whose pieces read differently at the start, e.g. SentencePiece's
    leading space) up to the new ones, at most about :data:`WINDOW` plus two pushes' ids while characters
    complete; a push decodes once, plus once more each time the window moves on. Only a push whose text holds
    a stop sequence decodes token by token (each its window) to find the token that completes it.
    """

    WINDOW = 32
    """Ids of read context past which the decoded window moves up to the previous push."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.window = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.hit = False
        self._prefix = 0
        self._read = 0
        self._last_read = 0
        self._prefix_text = ""
        self._confirmed = ""

    @property
    def used(self) -> int:
        return len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _extend(self, end: int) -> tuple[str, tuple | None]:
        """The text of ``ids[:end]`` (``end`` past the read ids) and the window state it leaves when its new
        ids read complete (None: held, the text ends in an incomplete character or did not grow). Decodes
        ``ids[_prefix:end]``. When the new ids change how the window's read part decodes, the text is the read
        text and one U+FFFD while they end in an incomplete character (a byte-fallback decoder turns a whole run
        of byte tokens into U+FFFD until it is valid), else the decode of all of ``ids[:end]`` (a tokenizer's
        clean-up across the boundary)."""
        after = self._decode(self.ids[self._prefix:end])
        if after.startswith(self._prefix_text):
            text = self._confirmed + after[len(self._prefix_text):]
        elif after.endswith("\ufffd"):
            text = self._confirmed + "\ufffd"
        else:
            text = self._decode(self.ids[:end])
        if len(after) <= len(self._prefix_text) or after.endswith("\ufffd"):
            return text, None
        return text, (end, after)

    def _commit(self, text: str, state: tuple | None) -> None:
        self.text = text
        if state is None:
            return
        end, self._prefix_text = state
        self._last_read, self._read, self._confirmed = self._read, end, text
        if end - self._prefix > self.WINDOW:
            self._prefix = self._last_read
            self._prefix_text = self._decode(self.ids[self._prefix:end])

    def _first_stop(self, text: str) -> int | None:
        """Where the first stop sequence begins in ``text`` (searched from where one could begin that the read
        text, complete characters only, does not hold), or None."""
        start = max(0, len(self._confirmed) - self.window)
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _pending_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins a stop sequence."""
        for k in range(min(self.window, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0

    def push(self, ids: list[int]) -> str:
        if self.hit or not ids:
            return ""
        start = len(self.ids)
        self.ids += ids
        text, state = self._extend(len(self.ids))
        if not self.stop or self._first_stop(text) is None:
            self._commit(text, state)
        else:  # a stop sequence is in there: find the token that completes it, one at a time
            for end in range(start + 1, len(self.ids) + 1):
                text, state = self._extend(end)
                if (at := self._first_stop(text)) is not None:
                    self.text, self.hit = text[:at], True
                    del self.ids[end:]
                    break
                self._commit(text, state)
        safe = len(self.text)
        if not self.hit:
            while safe > self.sent and self.text[safe - 1] == "\ufffd":
                safe -= 1
            safe -= self._pending_stop(self.text[:safe])
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
