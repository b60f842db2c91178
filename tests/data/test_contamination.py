"""Contamination guard: prompt normalization and hashes, the GSM8K-test training pool, drafter sidecars."""

from __future__ import annotations

import json

import pytest

from taps_ray.data import contamination as c
from taps_ray.data.benchmarks import benchmark_questions


def test_normalization_ignores_case_width_and_whitespace():
    assert c.normalize("  What  is\n2 + 2?\t") == "what is 2 + 2?"
    assert c.prompt_hash("What is ２ + 2?") == c.prompt_hash("what  is 2 + 2?")
    assert c.prompt_hash("What is 2 + 3?") != c.prompt_hash("What is 2 + 2?")
    assert len(c.prompt_hash("x")) == 64
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    assert c.conversation_hash(conv) == c.prompt_hash("hi there")
    with pytest.raises(ValueError, match="no user turn"):
        c.conversation_hash([{"role": "assistant", "content": "x"}])


def test_gsm8k_pools_are_disjoint_stable_and_about_three_quarters():
    questions, _ = benchmark_questions("gsm8k")
    texts = [q.turns[0] for q in questions]
    train = {t for t in texts if c.in_gsm8k_training_pool(t)}
    reserved = {t for t in texts if not c.in_gsm8k_training_pool(t)}
    assert train.isdisjoint(reserved) and len(train) + len(reserved) == len(set(texts))
    assert 0.70 < len(train) / len(texts) < 0.80
    # The rule is a function of the normalized text alone: the same in any copy, any run, any order.
    assert all(c.in_gsm8k_training_pool("  " + t.upper() + " ") for t in list(train)[:50])
    assert not any(c.in_gsm8k_training_pool(t.replace(" ", "  ")) for t in list(reserved)[:50])
    # Pinned: changing the rule would silently move questions between the pools.
    assert [c.in_gsm8k_training_pool(t) for t in texts[:12]] == [True, False, False, False, True, False, False,
                                                                  True, True, True, False, True]
    assert len(train) == 983 and len(texts) == 1319


def test_trained_prompts_round_trip_union_and_averaging(tmp_path):
    a, b, merged = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    for folder in (a, b, merged):
        folder.mkdir()
    ha, hb = {c.prompt_hash("q1"), c.prompt_hash("q2")}, {c.prompt_hash("q2"), c.prompt_hash("q3")}
    c.write_trained_prompts(a, c.trained_prompts_record(ha, ["math: somewhere"]))
    c.write_trained_prompts(b, c.trained_prompts_record(hb, ["chat: elsewhere"]))
    assert c.read_trained_prompts(a) == ha and c.read_trained_prompts(tmp_path) == set()
    assert c.write_averaged(merged, [a, b]) == merged / c.TRAINED_PROMPTS
    record = json.loads((merged / c.TRAINED_PROMPTS).read_text())
    assert set(record["sha256"]) == ha | hb and record["count"] == 3 and len(record["sources"]) == 2
    assert c.write_averaged(tmp_path / "none", [tmp_path]) is None


def test_malformed_prompt_files_name_the_file(tmp_path):
    (tmp_path / c.TRAINED_PROMPTS).write_text(json.dumps({"sha256": ["not-a-hash"]}))
    with pytest.raises(c.ContaminationError, match=str(tmp_path / c.TRAINED_PROMPTS)):
        c.read_trained_prompts(tmp_path)
    (tmp_path / c.TRAINED_PROMPTS).write_text("{")
    with pytest.raises(c.ContaminationError, match="unreadable"):
        c.read_trained_prompts(tmp_path)
    c.write_feature_prompts(tmp_path, [c.prompt_hash("a"), c.prompt_hash("b")])
    assert c.read_feature_prompts(tmp_path) == [c.prompt_hash("a"), c.prompt_hash("b")]
    assert c.read_feature_prompts(tmp_path / "missing") is None
