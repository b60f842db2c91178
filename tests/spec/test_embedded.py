"""Greedy exactness on the embedded SmolLM2-135M target (fp32): speculative output == vanilla output.

12 benchmark prompts (3 from each of MT-Bench, GSM8K, MATH-500, SVAMP in $TAPS_DATA_DIR) plus a
multi-turn chat; a freshly initialised drafter and an oracle strategy whose trees hold the target's
own continuation among decoys. Outputs are kept short (24 tokens; 12 with the fresh drafter, whose
steps accept nothing) so the module runs in under a minute.
"""

from __future__ import annotations

import json

import pytest
import torch

from taps_ray.cli import main
from taps_ray.config import TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import SingleStrategy
from tests.conftest import data_dir, requires_data
from tests.spec.spec_helpers import MULTI_TURN_CHAT, OracleStrategy, benchmark_messages

pytestmark = pytest.mark.integration

MAX_NEW = 24
MAX_PROMPT_TOKENS = 160
FRESH_NEW = 12
FRESH_TREE = TreeConfig(depth=2, top_k=2, total_tokens=5)
PER_BENCHMARK = 3


@pytest.fixture(scope="module")
def cases(embedded_target):
    """name -> (prompt ids [T], vanilla greedy result): the multi-turn chat, plus the benchmark prompts
    (first turns of at most MAX_PROMPT_TOKENS tokens) when TAPS_DATA_DIR is there."""
    chats = {"multi-turn": MULTI_TURN_CHAT}
    if data_dir() is not None:
        for i, messages in enumerate(benchmark_messages(12)):
            chats[f"bench-{i // 12}-{i % 12}"] = messages
    out = {}
    per_benchmark = {}
    for name, messages in chats.items():
        ids = embedded_target.encode_chat(messages)[0]
        group = name.rsplit("-", 1)[0]
        if name != "multi-turn" and (ids.numel() > MAX_PROMPT_TOKENS or per_benchmark.get(group, 0) == PER_BENCHMARK):
            continue
        per_benchmark[group] = per_benchmark.get(group, 0) + 1
        out[name] = (ids, generate(embedded_target, ids, max_new_tokens=MAX_NEW))
    return out


def bench_cases(cases) -> list[str]:
    names = [n for n in cases if n != "multi-turn"]
    assert len(names) == 4 * PER_BENCHMARK, (f"expected {PER_BENCHMARK} short prompts from each of the 4 "
                                             f"benchmarks, got {len(names)}")
    return names


def test_multi_turn_chat_exact(embedded_target, cases):
    ids, vanilla = cases["multi-turn"]
    fresh = generate(embedded_target, MULTI_TURN_CHAT, SingleStrategy(DraftHead(embedded_target.config), FRESH_TREE),
                     max_new_tokens=FRESH_NEW)
    assert fresh.prompt_len == ids.numel() and fresh.token_ids == vanilla.token_ids[:FRESH_NEW]
    sequence = torch.cat([ids, torch.tensor(vanilla.token_ids)])
    oracle = generate(embedded_target, ids, OracleStrategy(sequence, embedded_target.vocab_size, seed=1),
                      max_new_tokens=MAX_NEW)
    assert oracle.token_ids == vanilla.token_ids and max(oracle.accept_lengths) == 5


@requires_data
def test_fresh_drafter_greedy_equals_vanilla_on_benchmarks(embedded_target, cases):
    drafter = DraftHead(embedded_target.config, seed=0)
    mismatched = []
    for name in bench_cases(cases):
        ids, vanilla = cases[name]
        spec = generate(embedded_target, ids, SingleStrategy(drafter, FRESH_TREE), max_new_tokens=FRESH_NEW)
        if spec.token_ids != vanilla.token_ids[:FRESH_NEW]:
            mismatched.append(name)
    assert not mismatched


@requires_data
def test_oracle_greedy_equals_vanilla_on_benchmarks(embedded_target, cases):
    """Long accepted paths with KV compaction; every fourth prompt also stops on an EOS placed inside an
    accepted path (a token of the reply declared EOS), and every fourth (shifted by two) at a
    max_new_tokens that falls mid-path."""
    trimmed_eos = trimmed_length = 0
    for k, name in enumerate(bench_cases(cases)):
        ids, vanilla = cases[name]
        out = vanilla.token_ids
        sequence = torch.cat([ids, torch.tensor(out)])
        spec = generate(embedded_target, ids, OracleStrategy(sequence, embedded_target.vocab_size, seed=k),
                        max_new_tokens=MAX_NEW)
        assert spec.token_ids == out, name
        if k % 4 == 0:
            stop = next(i for i in range(2, len(out)) if out[i] not in out[:i] and (i - 1) % 6 != 5)
            spec = generate(embedded_target, ids, OracleStrategy(sequence, embedded_target.vocab_size, corrupt=False),
                            max_new_tokens=MAX_NEW, eos_token_ids={out[stop]})
            assert spec.token_ids == out[:stop + 1] and spec.finish_reason == "eos", name
            trimmed_eos += spec.steps[-1].appended < spec.steps[-1].accepted + 1
        if k % 4 == 2 and len(out) == MAX_NEW:
            spec = generate(embedded_target, ids, OracleStrategy(sequence, embedded_target.vocab_size, corrupt=False),
                            max_new_tokens=MAX_NEW - 3)
            assert spec.token_ids == out[:MAX_NEW - 3] and spec.finish_reason == "length", name
            trimmed_length += spec.steps[-1].appended < spec.steps[-1].accepted + 1
    assert trimmed_eos == 3 and trimmed_length >= 2


def write_config(tmp_path) -> str:
    path = tmp_path / "generate.yaml"
    path.write_text("target:\n  model: embedded:smollm2-135m\n  threads: 1\ntree:\n  depth: 2\n  top_k: 3\n"
                    "  total_tokens: 8\n")
    return str(path)


def test_cli_generate_json_vanilla_and_single_agree(tmp_path, capsys):
    config = write_config(tmp_path)
    args = ["generate", config, "--prompt", "What is 12 + 30?", "--max-new-tokens", "12", "--json"]
    assert main([*args, "--strategy", "vanilla"]) == 0
    vanilla = json.loads(capsys.readouterr().out)
    assert main([*args, "--strategy", "single"]) == 0
    captured = capsys.readouterr()
    single = json.loads(captured.out)
    assert "no --drafter given: using release:math" in captured.err
    for payload, strategy in [(vanilla, "vanilla"), (single, "single")]:
        assert {"text", "token_ids", "steps", "tau", "accept_lengths", "tokens_per_s", "strategy"} <= set(payload)
        assert payload["strategy"] == strategy and 1 <= len(payload["token_ids"]) <= 12
        assert payload["steps"] == len(payload["accept_lengths"]) and payload["tokens_per_s"] > 0
    assert single["token_ids"] == vanilla["token_ids"] and single["text"] == vanilla["text"]
    assert vanilla["tau"] == 1.0


def test_cli_generate_streams_the_text_and_ends_before_a_stop_sequence(tmp_path, capsys):
    config = write_config(tmp_path)
    args = ["generate", config, "--prompt", "What is 12 + 30?", "--max-new-tokens", "16", "--strategy", "vanilla"]
    assert main([*args, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    words = full["text"].split()
    stop = words[2]
    assert main([*args, "--stop", stop]) == 0
    captured = capsys.readouterr()
    assert captured.out == full["text"][:full["text"].index(stop)] + "\n"
    assert "vanilla, stop]" in captured.err
    assert main([*args, "--stop", stop, "--json"]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == full["token_ids"][:len(stopped["token_ids"])]


@pytest.mark.parametrize("extra, message", [
    (["--stop", ""], "--stop takes a non-empty text"),
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--temperature", "-1"], "temperature must be >= 0 (0 = greedy), got -1.0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--drafter", "/nonexistent/drafter"], "drafter directory '/nonexistent/drafter' does not exist"),
])
def test_cli_generate_bad_input_exits_2(tmp_path, capsys, extra, message):
    assert main(["generate", write_config(tmp_path), "--prompt", "hi", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"taps generate: error: {message}"
