"""The decode loop's stream: TextStream (stop sequences, partial characters), the observer hand-off, cancel and deadline."""

from __future__ import annotations

import random
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


# -- incremental detokenization: the text of a full decode, from a bounded window --------------------------

TEXTS = [
    "the cat naïve 日本語 😀 hello! é€",
    "Ünïcödé\n\n  two  spaces\ttab 🇫🇷👩‍👩‍👧 ∑∫ 𝔘𝔫𝔦 ½¾ — «quotes» ‘single’",
    "def f(x):\n    return x ** 2  # 😀😀 the end.",
]
STOPS = [None, ["日本"], ["!", "the end"], ["😀", "\n\n"], ["é€"]]


class FullDecode(TextStream):
    """What TextStream computed before it was incremental: every push decodes every id so far."""

    def _extend(self, end):
        return self._decode(self.ids[:end]), None


class Recording:
    """A tokenizer wrapper that records how many ids each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def embedded_tokenizer():
    """The embedded target's tokenizer (byte-level BPE: a multi-byte character can span tokens) without its model."""
    from transformers import AutoTokenizer

    from taps_ray.models.target_loading import embedded_hf_folder

    return AutoTokenizer.from_pretrained(str(embedded_hf_folder("smollm2-135m")))


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A SentencePiece-style tokenizer with byte fallback: a piece's leading space is stripped at the start of a
    decode (so a suffix decodes differently alone) and bytes of an unknown character are tokens of their own."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁", "▁the", "▁cat", "é", "▁naïve", "日本", "語", "▁hello", "!", "▁end", ".", "s", "▁def", "▁f"]
    pieces = ([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
              + [(w, -1.0) for w in words])
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _inputs(tokenizer, seed: int, random_ids: bool = True) -> list[list[int]]:
    """Id sequences: each text encoded, and again with specials spliced in at random; with ``random_ids``,
    random ids of the whole vocabulary too (partial and invalid byte sequences among them)."""
    rng = random.Random(seed)
    specials = list(tokenizer.all_special_ids)
    out = []
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        spliced = list(ids)
        for _ in range(3):
            spliced.insert(rng.randrange(len(spliced) + 1), rng.choice(specials))
        out += [ids, spliced]
    if random_ids:
        out.append([rng.randrange(len(tokenizer)) for _ in range(300)])
    return out


def _pushes(ids: list[int], rng: random.Random, most: int = 6) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


@pytest.mark.slow
def test_incremental_text_streams_exactly_what_decoding_everything_gave(embedded_tokenizer):
    """The embedded (byte-level) tokenizer, for unicode, multi-byte characters split over tokens, specials and
    random ids, in pushes of 1-6: every push returns the same delta, text, ``used`` and ``hit`` as decoding
    every id on every push did, and the text after every push is one decode of every id."""
    for seed in range(3):
        rng = random.Random(seed)
        for ids in _inputs(embedded_tokenizer, seed):
            for stop in STOPS:
                stream, reference = TextStream(embedded_tokenizer, stop), FullDecode(embedded_tokenizer, stop)
                for chunk in _pushes(ids, rng):
                    assert stream.push(chunk) == reference.push(chunk), (ids, stop)
                    assert (stream.text, stream.used, stream.hit) == (reference.text, reference.used, reference.hit)
                    if not stream.hit:
                        assert stream.text == embedded_tokenizer.decode(stream.ids, skip_special_tokens=True)
                assert stream.flush() == reference.flush()


def test_incremental_text_with_a_byte_fallback_sentencepiece_tokenizer(sentencepiece_tokenizer):
    """Leading spaces that a piece loses at the start of a decode, characters spelled in byte tokens, specials:
    after every push that ends on a complete character the text is one decode of every id, and what is
    streamed is the full decode up to the first stop sequence. (Decoding everything each push found a stop
    late there: the byte-fallback decoder turns a whole run of byte tokens into U+FFFD while it ends in an
    incomplete character, hiding complete ones before it.)"""
    tokenizer = sentencepiece_tokenizer
    for seed in range(3):
        rng = random.Random(seed)
        for ids in _inputs(tokenizer, seed, random_ids=False):
            full = tokenizer.decode(ids, skip_special_tokens=True)
            for stop in STOPS:
                stream, streamed = TextStream(tokenizer, stop), []
                for chunk in _pushes(ids, rng):
                    streamed.append(stream.push(chunk))
                    if not stream.hit and not stream.text.endswith("\ufffd"):
                        assert stream.text == tokenizer.decode(stream.ids, skip_special_tokens=True)
                streamed.append(stream.flush())
                found = [i for i in (full.find(s) for s in stop or []) if i >= 0]
                expected = full[:min(found)] if found else full
                assert "".join(streamed) == stream.text == expected and stream.hit == bool(found), (ids, stop)


def test_a_push_decodes_a_bounded_window_not_the_whole_output(embedded_tokenizer):
    """3000 ids pushed 1-4 at a time: no decode call sees more than 64 ids (twice the window), and a push decodes at most
    twice, so the work per push does not grow with the output (decoding it all each push reaches 3000 ids)."""
    rng = random.Random(0)
    ids = (embedded_tokenizer(" ".join(TEXTS) * 20, add_special_tokens=False)["input_ids"] * 10)[:3000]
    recording = Recording(embedded_tokenizer)
    stream = TextStream(recording, ["never appears"])
    pushes = _pushes(ids, rng, most=4)
    for chunk in pushes:
        stream.push(chunk)
    assert stream.used == 3000 and stream.text == embedded_tokenizer.decode(ids, skip_special_tokens=True)
    assert max(recording.sizes) <= 64, max(recording.sizes)
    assert len(recording.sizes) <= 2 * len(pushes), "at most two decodes a push"
