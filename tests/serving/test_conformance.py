"""OpenAI conformance without Ray: every response body and stream chunk of both endpoints (streamed or
not, with and without ``stream_options.include_usage`` and logprobs) validates against the ``openai``
package's own types, strictly (a missing field fails, no unknown field but ``taps``); every OpenAI request
field the server does not honour is a 400 naming it; served logprobs equal the target's log-softmax.

The ingress's FastAPI app runs in-process over the real :class:`Verifier` decode loop on a tiny bigram
target with a toy tokenizer, drafting speculatively with an in-process drafter (``taps.strategy: single``)."""

from __future__ import annotations

import asyncio
import typing
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai.types as oai
import openai.types.chat as oai_chat
import pydantic
import pytest
import ray.serve
import torch
from openai.types.chat import completion_create_params as chat_params

from taps_ray.config import ServeConfig, TreeConfig
from taps_ray.serving import ingress, protocol
from taps_ray.serving.drafter import DraftSessions
from taps_ray.serving.logprobs import TokenPieces
from taps_ray.serving.verifier import Verifier
from taps_ray.spec.decoder import generate
from tests.serving.helpers import LocalClient
from tests.serving.test_access import _asgi, assert_error, sse_events
from tests.spec.spec_helpers import bigram_target, oracle_drafter

MODEL = "tiny"
TREE = TreeConfig(depth=3, top_k=4, total_tokens=12, lookup_tokens=0)
NEW = 24
EOS = 1
ATOL = 1e-4


class CompletionStreamChoice(oai.CompletionChoice):
    """A streamed completions choice: ``finish_reason`` is null until the last text chunk (as the OpenAI
    API streams it; the ``openai`` package constructs stream chunks without validating them, and its
    ``Completion`` type declares the field non-null). Still required."""

    finish_reason: typing.Literal["stop", "length", "content_filter"] | None


class CompletionChunk(oai.Completion):
    choices: list[CompletionStreamChoice]


def conforms(model: type[pydantic.BaseModel], data: dict) -> pydantic.BaseModel:
    """``data`` validated strictly as ``model``; no field outside the type but the top-level ``taps``."""
    parsed = model.model_validate(data, strict=True)

    def unknown(obj, where: str) -> list[str]:
        if isinstance(obj, pydantic.BaseModel):
            extra = [f"{where}.{k}" for k in (obj.model_extra or {}) if not (where == "" and k == "taps")]
            return extra + [u for name in type(obj).model_fields for u in unknown(getattr(obj, name), f"{where}.{name}")]
        if isinstance(obj, list):
            return [u for i, item in enumerate(obj) for u in unknown(item, f"{where}[{i}]")]
        return []

    assert not unknown(parsed, ""), f"fields outside {model.__name__}: {unknown(parsed, '')}"
    return parsed


class ToyTokenizer:
    """Token i reads ``PIECES[i]`` (EOS is the special ``</s>``, some pieces are not ASCII); text and chat
    messages encode one token per character."""

    PIECES = ["<s>", "</s>"] + [(" " if i % 5 == 0 else "") + "abcdefghijklmnopqrstuvwxyzéß"[i % 28] + "ü" * (i % 7 == 0)
                                for i in range(2, 256)]
    eos_token_id = EOS

    def __call__(self, text: str) -> dict:
        return {"input_ids": [2 + ord(c) % 254 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i < 2))

    def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        return self("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")["input_ids"]


class Handle:
    """A deployment handle over an in-process :class:`Verifier`: ``generate.remote`` streams its events."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier

    def options(self, **kwargs):
        return self

    @property
    def generate(self):
        verifier = self.verifier

        class Stream:
            def __init__(self, request):
                self.events = verifier.generate(request)

            def __aiter__(self):
                return self

            async def __anext__(self):
                return await self.events.__anext__()

            def cancel(self):
                pass

        return SimpleNamespace(remote=Stream)


@pytest.fixture(scope="module")
def target():
    target = bigram_target(0)
    target.tokenizer = ToyTokenizer()
    return target


@pytest.fixture
def call(target, monkeypatch):
    """``call(path, body) -> (status, headers, body)`` against the ingress over the real verifier (drafter
    ``a``: an oracle drafter, in-process)."""
    cfg = ServeConfig(drafters={"a": None}, routing={"draft_deadline_s": 30})
    verifier = object.__new__(Verifier)
    verifier.target, verifier.cfg, verifier.tree = target, cfg, TREE
    verifier.clients = {"a": LocalClient([DraftSessions(target, oracle_drafter(target), TREE)])}
    verifier.pool = ThreadPoolExecutor(2)
    verifier.pieces = TokenPieces(target.tokenizer)
    verifier._init_counts()
    instance = ingress.Ingress.__mro__[1](Handle(verifier), cfg.model_dump(), {}, MODEL, [], [])
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(servable_object=instance))
    monkeypatch.delenv("TAPS_API_KEY", raising=False)

    def call(path: str, body: dict):
        import json
        raw = json.dumps(body).encode()
        headers = {"host": "testserver", "content-type": "application/json", "content-length": str(len(raw))}
        return asyncio.run(_asgi(ingress.app, "POST", path, headers, [raw]))

    yield call
    verifier.pool.shutdown()


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PROMPT = "the quick brown fox"


def body_for(path: str, stream: bool, usage: bool, top: int | None, **extra) -> dict:
    body = {"model": MODEL, "max_tokens": NEW, "stream": stream, "taps": {"strategy": "single"}, **extra}
    if usage:
        body["stream_options"] = {"include_usage": True}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": PROMPT}]
        if top is not None:
            body.update(logprobs=True, top_logprobs=top)
    else:
        body["prompt"] = PROMPT
        if top is not None:
            body["logprobs"] = top
    return body


def entries_of(path: str, logprobs: dict | None) -> list[tuple[str, float, list]]:
    """(token, logprob, top alternatives as (token, logprob)) per token of a choice's ``logprobs``."""
    if logprobs is None:
        return []
    if path == CHAT:
        return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                for e in logprobs["content"]]
    return [(tok, lp, list(top.items())) for tok, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                                                  logprobs["top_logprobs"], strict=True)]


def test_the_pure_builders_conform_and_a_missing_field_fails():
    entry = {"token": "é", "logprob": -0.5, "bytes": [195, 169], "text_offset": 0,
             "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                              {"token": "x", "logprob": -float("inf"), "bytes": [120]}]}
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    for logprobs in (None, [entry]):
        chat = conforms(oai_chat.ChatCompletion, protocol.chat_response("c", MODEL, "é", "stop", usage, {}, logprobs))
        done = conforms(oai.Completion, protocol.completion_response("c", MODEL, "é", "length", usage, {}, logprobs))
        conforms(oai_chat.ChatCompletionChunk, protocol.chat_chunk("c", MODEL, 1, {"content": "é"}, None,
                                                                   include_usage=True, logprobs=logprobs))
        conforms(CompletionChunk, protocol.completion_chunk("c", MODEL, 1, "é", logprobs=logprobs))
        if logprobs:
            assert chat.choices[0].logprobs.content[0].top_logprobs[1].logprob == protocol.LOGPROB_FLOOR
            assert done.choices[0].logprobs.text_offset == [0] and done.choices[0].logprobs.top_logprobs[0]["x"] < -9000
    conforms(oai_chat.ChatCompletionChunk, protocol.chat_chunk("c", MODEL, 1, None, usage=usage, include_usage=True))
    broken = protocol.chat_response("c", MODEL, "x", "stop", usage, {})
    del broken["choices"][0]["finish_reason"]
    with pytest.raises(pydantic.ValidationError, match="finish_reason"):
        conforms(oai_chat.ChatCompletion, broken)
    with pytest.raises(pydantic.ValidationError, match="created"):
        conforms(CompletionChunk, {k: v for k, v in protocol.completion_chunk("c", MODEL, 1, "x").items()
                                   if k != "created"})
    with pytest.raises(AssertionError, match="fields outside"):
        conforms(oai.Completion, {**protocol.completion_response("c", MODEL, "x", "stop", usage, {}), "extra": 1})


@pytest.mark.parametrize("top", [None, 0, 3])
@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_every_response_and_chunk_validates_and_streams_what_the_body_says(call, path, usage, top):
    chat = path == CHAT
    status, _, whole = call(path, body_for(path, False, usage, top))
    assert status == 200, whole
    parsed = conforms(oai_chat.ChatCompletion if chat else oai.Completion, whole)
    text = parsed.choices[0].message.content if chat else parsed.choices[0].text
    assert parsed.usage.completion_tokens == NEW and text
    status, headers, raw = call(path, body_for(path, True, usage, top))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [conforms(oai_chat.ChatCompletionChunk if chat else CompletionChunk, e) for e in events[:-1]]
    if usage:
        *chunks, last = chunks
        assert last.choices == [] and last.usage == parsed.usage
        assert all("usage" in e and e["usage"] is None for e in events[:len(chunks)])
    else:
        assert all("usage" not in e for e in events[:-1])
    assert all(c.id == chunks[0].id and c.created == chunks[0].created for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    if chat:
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == text
    whole_logprobs = entries_of(path, whole["choices"][0]["logprobs"])
    streamed_logprobs = [e for raw_chunk in events[:len(chunks)] for e in
                         entries_of(path, raw_chunk["choices"][0]["logprobs"])]
    assert streamed_logprobs == whole_logprobs
    if top is None:
        assert whole["choices"][0]["logprobs"] is None
        assert all(e["choices"][0]["logprobs"] is None for e in events[:len(chunks)])
    else:
        assert len(whole_logprobs) == NEW and all(len(alts) == top for _, _, alts in whole_logprobs)
        special = ToyTokenizer.PIECES[:2]
        assert "".join(token for token, _, _ in whole_logprobs if token not in special) == text


@pytest.mark.parametrize("path, top", [(CHAT, 5), (COMPLETIONS, 2)])
def test_served_greedy_logprobs_equal_the_target_log_softmax(call, target, path, top):
    """Speculative greedy decoding through the server reports, per token, the raw log-softmax of the
    target's logits that vanilla decoding computes (fp32, within 1e-4), with the same top alternatives."""
    status, _, whole = call(path, body_for(path, False, False, top, temperature=0))
    assert status == 200, whole
    assert whole["taps"]["accepted_tokens"] > 0, "the drafter's trees were verified"
    tokenizer = target.tokenizer
    prompt = tokenizer.apply_chat_template(body_for(CHAT, False, False, None)["messages"]) if path == CHAT \
        else tokenizer(PROMPT)["input_ids"]
    vanilla = generate(target, prompt, max_new_tokens=NEW, logprobs=top)
    served = entries_of(path, whole["choices"][0]["logprobs"])
    assert [token for token, _, _ in served] == [tokenizer.PIECES[i] for i in vanilla.token_ids]
    torch.testing.assert_close(torch.tensor([lp for _, lp, _ in served]), vanilla.logprobs.logprobs, atol=ATOL, rtol=0)
    for (_, _, alternatives), ids, values in zip(served, vanilla.logprobs.top_ids, vanilla.logprobs.top_logprobs,
                                                 strict=True):
        assert [token for token, _ in alternatives] == [tokenizer.PIECES[i] for i in ids]
        torch.testing.assert_close(torch.tensor([lp for _, lp in alternatives]), values, atol=ATOL, rtol=0)
    if path == CHAT:
        first = whole["choices"][0]["logprobs"]["content"][0]
        assert bytes(first["bytes"]).decode() == first["token"]
    else:
        offsets = whole["choices"][0]["logprobs"]["text_offset"]
        assert offsets == [len("".join(t for t, _, _ in served[:i])) for i in range(len(served))]


def test_a_stop_sequence_trims_the_logprobs_with_the_text(call, target):
    _, _, full = call(COMPLETIONS, body_for(COMPLETIONS, False, False, 1))
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    for stream in (False, True):
        status, _, raw = call(COMPLETIONS, body_for(COMPLETIONS, stream, True, 1, stop=[stop]))
        assert status == 200, raw
        pieces = [raw] if not stream else sse_events(raw)[:-2]
        texts = "".join(p["choices"][0]["text"] for p in pieces)
        tokens = [e[0] for p in pieces for e in entries_of(COMPLETIONS, p["choices"][0]["logprobs"])]
        usage = raw["usage"] if not stream else sse_events(raw)[-2]["usage"]
        assert texts == text[:text.index(stop)] and len(tokens) == usage["completion_tokens"]
        said = "".join(t for t in tokens if t not in ToyTokenizer.PIECES[:2])
        assert said.startswith(texts) and said.endswith(stop[-1]) and stop in said, "up to the token ending the stop"


def test_token_pieces_give_the_exact_bytes_of_byte_level_tokens():
    """A token holding part of a character reads U+FFFD but its ``bytes`` are the exact UTF-8 bytes, which
    join to the text; special tokens read by name."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from taps_ray.serving.logprobs import byte_decoder

    assert set(byte_decoder()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(byte_decoder().values()) == list(range(256))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["hello world"], trainers.BpeTrainer(vocab_size=280, special_tokens=["<eos>"],
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    pieces, text = TokenPieces(tokenizer), "é hello 😀"
    ids = tokenizer(text)["input_ids"]
    assert pieces.byte_level and len(ids) > len(text.split())
    assert bytes(b for i in ids for b in pieces(i)[1]).decode() == text
    assert pieces(ids[0]) == ("\ufffd", [0xC3]) and pieces(tokenizer.eos_token_id) == ("<eos>", list(b"<eos>"))
    assert TokenPieces(ToyTokenizer())(30) == (ToyTokenizer.PIECES[30], list(ToyTokenizer.PIECES[30].encode()))


# -- request fields the server does not honour ------------------------------------------------------

SERVED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "store"}
IGNORED = {"user", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
           "safety_identifier"}
"""Hints that do not change the output (routing, caching, identification): accepted and ignored."""
BAD = {"logit_bias": {"50256": -100}, "presence_penalty": 0.5, "frequency_penalty": -1.0,
       "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "parallel_tool_calls": False,
       "functions": [{"name": "f"}], "function_call": "auto", "response_format": {"type": "json_object"},
       "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
       "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
       "web_search_options": {}, "moderation": {"input": {}}, "echo": True, "best_of": 2,
       "suffix": "end"}


@pytest.mark.parametrize("params, table", [(chat_params.CompletionCreateParamsBase, protocol.CHAT_UNSUPPORTED),
                                           (oai.completion_create_params.CompletionCreateParamsBase,
                                            protocol.COMPLETION_UNSUPPORTED)])
def test_every_openai_request_field_is_served_ignored_or_refused(params, table):
    """Against the installed ``openai`` package's request types, so a field it gains is noticed here."""
    fields = set(typing.get_type_hints(params))
    assert fields - SERVED - IGNORED - set(table) == set() and set(table) <= fields


@pytest.mark.parametrize("field", sorted(set(protocol.CHAT_UNSUPPORTED) | set(protocol.COMPLETION_UNSUPPORTED)))
def test_an_unsupported_field_is_a_400_naming_it_and_its_neutral_value_is_accepted(call, field):
    path = CHAT if field in protocol.CHAT_UNSUPPORTED else COMPLETIONS
    error = assert_error(call(path, body_for(path, False, False, None, max_tokens=2, **{field: BAD[field]})), 400,
                         field)
    assert error["message"].startswith(f"{field}: not supported by this server")
    table = protocol.CHAT_UNSUPPORTED if path == CHAT else protocol.COMPLETION_UNSUPPORTED
    for neutral in table[field]:
        status, _, data = call(path, body_for(path, False, False, None, max_tokens=2, **{field: neutral}))
        assert status == 200, (neutral, data)


@pytest.mark.parametrize("path, extra, param", [
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"logprobs": 3}, "logprobs"),
    (COMPLETIONS, {"logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"logprobs": 1.5}, "logprobs"),
    (CHAT, {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "t"}]},
                         {"role": "user", "content": "y"}]}, "messages.0.tool_calls"),
    (CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "t"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "messages"),
])
def test_bad_logprobs_and_tool_messages_are_400s_naming_the_field(call, path, extra, param):
    assert_error(call(path, {**body_for(path, False, False, None), **extra}), 400, param)


def test_ignored_hints_are_accepted(call):
    hints = {"user": "u", "metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_key": "k",
             "safety_identifier": "s", "store": True}
    status, _, data = call(CHAT, body_for(CHAT, False, False, None, max_tokens=2, **hints))
    assert status == 200, data
