"""benchmarks/lm_eval_lossless.py: lm-eval scores GSM8K through ``taps serve`` with speculation and vanilla.

The pure parts (reading lm-eval's sample records, accuracy, the question-by-question comparison, what the
server's counters must show, what fails a run) on hand-made records; then the script end to end, tiny (two
questions, a few tokens), and its comparison on that run's own samples with one response altered."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks.lm_eval_lossless import (
    TASK,
    accuracy,
    compare,
    failures,
    read_samples,
    served_counts,
    served_delta,
    served_failures,
    write_task,
)
from tests.conftest import REPO


def _sample(doc_id: int, response: str, answer: str, filter_name: str, score: float) -> dict:
    question = f"question {doc_id}?"
    return {"doc_id": doc_id, "doc": {"id": 100 + doc_id, "question": question, "answer": "x\n#### 7"},
            "target": "x\n#### 7", "arguments": {"gen_args_0": {"arg_0": [question], "arg_1": {}}},
            "resps": [[response]], "filtered_resps": [answer], "filter": filter_name, "metrics": ["exact_match"],
            "exact_match": score}


def _write(folder, records: list[dict]) -> None:
    path = folder / "smollm2-135m" / f"samples_{TASK}_2026-01-01T00-00-00.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(folder, responses: dict[int, str]) -> dict[int, dict]:
    records = []
    for doc_id, text in responses.items():
        right = text.endswith("7")
        records += [_sample(doc_id, text, "7" if right else "[invalid]", "strict-match", float(right)),
                    _sample(doc_id, text, text.split()[-1], "flexible-extract", float(right))]
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder, records)
    return read_samples(folder)


def test_samples_by_question(tmp_path):
    records = _run(tmp_path / "a", {0: "so #### 7", 1: "it is 8"})
    assert sorted(records) == [0, 1]
    assert records[0] == {"question": "question 0?", "response": "so #### 7", "filters": {
        "strict-match": {"answer": "7", "exact_match": 1.0}, "flexible-extract": {"answer": "7", "exact_match": 1.0}}}
    assert accuracy(records) == {"strict-match": 0.5, "flexible-extract": 0.5}


def test_unreadable_samples(tmp_path):
    with pytest.raises(ValueError, match="log_samples"):
        read_samples(tmp_path)
    _write(tmp_path, [{"doc_id": 0, "resps": [["x"]]}])
    with pytest.raises(ValueError, match="not an lm-eval sample record"):
        read_samples(tmp_path)
    _write(tmp_path, [_sample(0, "a 7", "7", "strict-match", 1.0), _sample(0, "b 7", "7", "flexible-extract", 1.0)])
    with pytest.raises(ValueError, match="two responses"):
        read_samples(tmp_path)


def test_identical_runs_pass(tmp_path):
    responses = {0: "so #### 7", 1: "it is 8", 2: "maybe 7"}
    comparison = compare(_run(tmp_path / "s", responses), _run(tmp_path / "v", responses))
    assert comparison["compared"] == comparison["identical"] == 3 and comparison["differing"] == []
    assert comparison["accuracy"]["speculative"] == comparison["accuracy"]["vanilla"]
    assert failures(comparison, 3) == []


def test_a_differing_answer_fails_even_at_equal_accuracy(tmp_path):
    speculative = _run(tmp_path / "s", {0: "so #### 7", 1: "it is 8", 2: "it is 9"})
    vanilla = _run(tmp_path / "v", {0: "so #### 7", 1: "it is 8", 2: "it is 10"})
    comparison = compare(speculative, vanilla)
    assert comparison["identical"] == 2 and [d["doc_id"] for d in comparison["differing"]] == [2]
    assert comparison["accuracy"]["speculative"] == comparison["accuracy"]["vanilla"]
    found = failures(comparison, 3)
    assert len(found) == 1 and "1 of 3 answers differ" in found[0] and "doc 2" in found[0]


def test_a_differing_score_or_accuracy_fails(tmp_path):
    speculative = _run(tmp_path / "s", {0: "so #### 7", 1: "it is 8"})
    vanilla = _run(tmp_path / "v", {0: "so #### 7", 1: "it is 8"})
    vanilla[1]["filters"]["flexible-extract"]["exact_match"] = 1.0
    found = failures(compare(speculative, vanilla), 2)
    assert any("answers differ" in f for f in found) and any("accuracy differs" in f for f in found)


def test_missing_questions_fail(tmp_path):
    speculative = _run(tmp_path / "s", {0: "so #### 7", 1: "it is 8"})
    vanilla = _run(tmp_path / "v", {0: "so #### 7", 2: "it is 8"})
    comparison = compare(speculative, vanilla)
    assert comparison["only_speculative"] == [1] and comparison["only_vanilla"] == [2]
    found = failures(comparison, 3)
    assert any("1 questions compared, expected 3" in f for f in found)
    assert any("only in the speculative run: [1]" in f for f in found)
    assert any("only in the vanilla run: [2]" in f for f in found)


METRICS = """\
# HELP taps_strategy_requests_total Finished requests by strategy
# TYPE taps_strategy_requests_total counter
taps_strategy_requests_total{model_name="smollm2-135m",strategy="routed:confidence"} 3.0
taps_strategy_requests_total{model_name="smollm2-135m",strategy="vanilla"} 2.0
taps_spec_decode_num_drafts_total{model_name="smollm2-135m"} 40.0
vllm:spec_decode_num_drafts_total{model_name="smollm2-135m"} 40.0
"""


def test_the_server_counts_each_runs_strategy():
    before = served_counts(METRICS)
    assert before == {"strategies": {"routed:confidence": 3.0, "vanilla": 2.0}, "draft_trees": 40.0}
    after = served_counts(METRICS.replace("} 2.0", "} 4.0"))
    vanilla = served_delta(before, after)
    assert vanilla == {"strategies": {"vanilla": 2}, "draft_trees": 0}
    assert served_failures("vanilla", "vanilla", vanilla, 2) == []
    assert "expected {'vanilla': 3}" in served_failures("vanilla", "vanilla", vanilla, 3)[0]
    assert "0 draft trees" in served_failures("speculative", "routed:confidence", vanilla, 2)[-1]
    speculative = served_delta(before, served_counts(METRICS.replace("} 3.0", "} 5.0").replace("} 40.0", "} 52.0")))
    assert speculative == {"strategies": {"routed:confidence": 2}, "draft_trees": 12}
    assert served_failures("speculative", "routed:confidence", speculative, 2) == []
    assert "12 draft trees" in served_failures("vanilla", "vanilla", {**speculative, "strategies": {"vanilla": 2}},
                                               2)[0]


def test_the_task_asks_for_the_strategy(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    text = (write_task(tmp_path / "t", data, "single:math", 32) / f"{TASK}.yaml").read_text()
    assert f"task: {TASK}" in text and f"test: {json.dumps(str(data.resolve()))}" in text
    assert 'strategy: "single:math"' in text and "max_gen_toks: 32" in text
    assert 'doc_to_text: "Question: {{question}}\\nAnswer:"' in text


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1200)
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                    reason="lm-eval is not installed (the bench extra: pip install -e '.[bench]')")
def test_lm_eval_against_taps_serve(tmp_path):
    """The script end to end without TAPS_DATA_DIR: exit 0, the same answers and accuracy with speculation as
    with vanilla, each run served with its strategy; its comparison on this run's samples catches an altered
    response."""
    out = tmp_path / "lm"
    env = {k: v for k, v in os.environ.items() if k != "TAPS_DATA_DIR"}
    cmd = [sys.executable, "benchmarks/lm_eval_lossless.py", "--limit", "2", "--max-tokens", "12",
           "--strategy", "single:math", "--set", "target.threads=1", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "lm_eval_lossless.json").read_text())
    assert summary["failures"] == [] and summary["questions"] == 2
    assert summary["comparison"]["compared"] == summary["comparison"]["identical"] == 2
    assert [r["served"]["strategies"] for r in summary["runs"]] == [{"single:math": 2}, {"vanilla": 2}]
    assert summary["runs"][0]["served"]["draft_trees"] > 0 and summary["runs"][1]["served"]["draft_trees"] == 0

    speculative, vanilla = read_samples(out / "lm_eval" / "speculative"), read_samples(out / "lm_eval" / "vanilla")
    assert failures(compare(speculative, vanilla), 2) == []
    first = next(iter(vanilla))
    vanilla[first]["response"] += " (altered)"
    found = failures(compare(speculative, vanilla), 2)
    assert len(found) == 1 and "1 of 2 answers differ" in found[0]
