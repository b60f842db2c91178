"""The decode loop's stream: TextStream (stop sequences, partial characters), the observer hand-off, cancel and deadline."""

from __future__ import annotations

import threading
import time

import pytest

from taps_ray.spec.stream import TextStream, interrupted, observe, text_stream


class CharTokenizer:
    """Token id i decodes to chr(i); id 0 stands for half of a multi-byte character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\ufffd" if i == 0 else chr(i) for i in ids)


def test_text_stream_holds_back_possible_stops_and_partial_characters():
    stream = TextStream(CharTokenizer(), ["END"])
    assert stream.push([ord(c) for c in "abcE"]) == "abc"
    assert stream.push([ord("N")]) == ""
    assert stream.push([ord("x")]) == "ENx"
    assert stream.push([ord(c) for c in "yENDzz"]) == "y"
    assert stream.hit and stream.text == "abcENxy" and stream.used == 10 and stream.push([65]) == ""
    assert stream.flush() == ""
    partial = TextStream(CharTokenizer())
    assert partial.push([ord("a"), 0]) == "a" and partial.flush() == "\ufffd"
    plain = TextStream(CharTokenizer())
    assert plain.push([ord("h"), ord("i")]) == "hi" and plain.flush() == "" and plain.used == 2


class CountingTokenizer(CharTokenizer):
    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return super().decode(ids, skip_special_tokens)


def test_a_push_decodes_once_unless_it_holds_a_stop():
    tokenizer = CountingTokenizer()
    stream = TextStream(tokenizer, ["END"])
    assert stream.push([ord(c) for c in "abcdefgh"]) == "abcdefgh" and tokenizer.calls == 1
    assert stream.push([ord(c) for c in "xyENDzz"]) == "xy" and stream.used == 13
    assert tokenizer.calls == 1 + 1 + 5, "one look at the whole push, then token by token up to the D"


def test_interrupted_names_the_reason():
    flag = threading.Event()
    assert interrupted(flag, time.monotonic() + 60) is None and interrupted(None, None) is None
    assert interrupted(None, time.monotonic() - 1) == "timeout"
    flag.set()
    assert interrupted(flag, time.monotonic() - 1) == "cancelled", "a cancel wins over a passed deadline"


def test_observe_cuts_at_the_stop_and_hands_the_observer_the_kept_tokens():
    seen = []

    class Observer:
        def on_step(self, tokens, text):
            seen.append((tokens, text))
            return "mine" if len(seen) == 2 else None

    stream = text_stream(CharTokenizer(), ["END"], None)
    observer = Observer()
    assert observe(stream, observer, [ord(c) for c in "abE"]) == ([ord(c) for c in "abE"], None)
    kept, reason = observe(stream, observer, [ord(c) for c in "NDxy"])
    assert kept == [ord("N"), ord("D")] and reason == "stop", "the stop wins over the observer's own reason"
    assert seen == [([97, 98, 69], "ab"), ([78, 68], "")] and stream.text == "ab"
    assert text_stream(None, None, None) is None and text_stream(CharTokenizer(), None, None) is None
    with pytest.raises(ValueError, match="non-empty strings"):
        text_stream(CharTokenizer(), "END", None)
    with pytest.raises(ValueError, match="tokenizer"):
        text_stream(None, ["END"], None)
