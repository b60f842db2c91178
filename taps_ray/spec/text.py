"""Incremental detokenization of a decode loop's committed tokens, with stop sequences
(:class:`TextStream`): the decode loop owns one per request that has stop sequences or a step observer."""

from __future__ import annotations


class TextStream:
    """Incremental detokenization with stop sequences.

    :meth:`push` takes committed token ids and returns the text that is safe to send: it holds back
    a tail that may still grow into a stop sequence and an incomplete character at the end. After
    a stop sequence, ``hit`` is set, the text ends before it and ``used`` counts the tokens consumed.
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

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _pending_stop(self) -> int:
        """Length of the longest tail of the text that begins a stop sequence."""
        for k in range(min(self.window, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stop):
                return k
        return 0

    def push(self, ids: list[int]) -> str:
        if self.hit or not ids:
            return ""
        if not self.stop:
            self.ids += ids
            self.text = self._decode()
        else:
            for token in ids:
                self.ids.append(token)
                text = self._decode()
                start = max(0, len(self.text) - self.window)
                found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
                if found:
                    self.text, self.hit = text[:min(found)], True
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
