"""TextStream: incremental detokenization that holds back possible stop sequences and partial characters."""

from __future__ import annotations

from taps_ray.spec.text import TextStream


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
