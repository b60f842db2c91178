"""The decode benchmark on a tiny target: every method runs, greedy outputs agree, files are written."""

from __future__ import annotations

import json
import math

import pytest
import torch

from taps_ray.config import TreeConfig
from taps_ray.eval.bench import run_bench, write_report
from taps_ray.models.drafter import DraftHead
from tests.spec.spec_helpers import peaky_tiny_target, random_prompt


def test_bench_tiny_target(tmp_path):
    target = peaky_tiny_target(0)
    prompts = [random_prompt(target, 12, seed) for seed in range(2)]
    report = run_bench(target, prompts, DraftHead(target.config, seed=1), TreeConfig(depth=2, top_k=3, total_tokens=8),
                       max_new_tokens=10, sweep_total=[4, 8], sweep_depth=[1], sweep_lookup=[0, 3],
                       settings={"benchmark": "random", "drafter": "fresh"})
    rows = {row.method: row for row in report.methods}
    assert list(rows) == ["vanilla", "hf-greedy", "hf-prompt-lookup", "spec", "spec-cost"]
    assert 1 <= rows["spec-cost"].steps <= rows["vanilla"].steps
    assert report.settings["engine"].startswith("static") and report.settings["weight_read_ms"] > 0
    assert "plain step" in report.settings["cost_model"] and "Cost model (spec-cost)" in report.to_markdown()
    for row in rows.values():
        assert row.match == 1.0 and row.prompts == 2 and row.tokens == 20 and row.tokens_per_s > 0
    assert rows["vanilla"].speedup == rows["vanilla"].cpu_speedup == 1.0 and math.isnan(rows["vanilla"].speedup_low)
    for row in list(rows.values())[1:]:
        assert row.speedup_low <= row.speedup <= row.speedup_high, (row.method, row.speedup_low, row.speedup_high)
    assert rows["vanilla"].tau == 1.0 and rows["hf-greedy"].tau == 1.0 and rows["spec"].step_cpu_ms > 0
    # every token but each prompt's first (from the prefill) comes from a step; lookup never needs more
    for method in ("hf-prompt-lookup", "spec"):
        assert rows[method].tau == pytest.approx((20 - 2) / rows[method].steps)
        assert 2 <= rows[method].steps <= rows["vanilla"].steps == 18
    assert [(r["depth"], r["total_tokens"], r["lookup_tokens"]) for r in report.sweep] == [
        (1, 4, 0), (1, 4, 3), (1, 8, 0), (1, 8, 3)]
    assert all(r["break_even_tau"] > 0 and r["vanilla_ms"] > 0 for r in report.sweep)
    best = max(report.sweep, key=lambda r: r["cpu_speedup"])
    json_path, md_path = write_report(report, tmp_path / "bench")
    written = json.loads(json_path.read_text())
    assert written["outputs"]["spec"] == report.outputs["vanilla"] and written["picked_tree"] == best
    assert sorted(p.name for p in json_path.parent.iterdir()) == ["bench.json", "bench.md"]
    markdown = md_path.read_text()
    assert "| hf-prompt-lookup |" in markdown and "break-even tau" in markdown
    spec = rows["spec"]
    assert f"| {spec.speedup:.2f}x [{spec.speedup_low:.2f}, {spec.speedup_high:.2f}] |" in markdown
    assert (f"tree.depth={best['depth']} tree.top_k={best['top_k']} tree.total_tokens={best['total_tokens']} "
            f"tree.lookup_tokens={best['lookup_tokens']}") in markdown
    assert written["exactness"]["identical"] == {"hf-greedy": 2, "hf-prompt-lookup": 2, "spec": 2, "spec-cost": 2}
    assert written["exactness"]["divergences"] == [] and "## Exactness" in markdown


def test_bench_sampling_reports_speed_and_tau_without_matching():
    from taps_ray.config import SamplingConfig

    target = peaky_tiny_target(0)
    prompts = [random_prompt(target, 12, seed) for seed in range(2)]
    report = run_bench(target, prompts, DraftHead(target.config, seed=1), TreeConfig(depth=2, top_k=3, total_tokens=8),
                       max_new_tokens=8, sampling=SamplingConfig(temperature=1.0, top_p=0.9, seed=3),
                       settings={"benchmark": "random", "drafter": "fresh"})
    rows = {row.method: row for row in report.methods}
    assert list(rows) == ["vanilla", "spec", "spec-cost"] and report.exactness is None
    assert rows["spec"].tau == pytest.approx((rows["spec"].tokens - 2) / rows["spec"].steps)
    assert rows["spec"].match != rows["spec"].match  # NaN: draws are not compared
    assert "sampling T=1.0 top_p=0.9" in report.to_markdown()


def test_a_warm_up_run_is_forgotten_by_the_cost_model_budget():
    """run_methods warms every method up on a few tokens; the spec-cost budget must not keep what it saw."""
    from taps_ray.eval.bench import run_methods

    calls = []

    def method(ids):
        calls.append(("run", len(ids)))

    method.reset = lambda: calls.append(("reset", 0))
    prompts = [torch.arange(2, 30), torch.arange(3, 20)]
    run_methods(prompts, {"spec-cost": method})
    assert calls == [("run", 8), ("reset", 0), ("run", 28), ("run", 17)]


def test_the_report_states_the_compile_seconds_apart_from_the_timed_runs():
    from types import SimpleNamespace

    target = peaky_tiny_target(0)
    target.engine.compiled = SimpleNamespace(compiles=2, compile_s=12.34, applies=lambda segments: False)
    report = run_bench(target, [random_prompt(target, 12, 0)], DraftHead(target.config, seed=1),
                       TreeConfig(depth=1, top_k=2, total_tokens=4), max_new_tokens=4, hf=False,
                       settings={"benchmark": "random", "drafter": "fresh"})
    assert report.settings["compiled_graphs"] == 2 and report.settings["compile_s"] == 12.3
    assert report.settings["engine"].endswith("-compiled")
    assert "Compiled steps: 2 graphs compiled in 12.3 s (at first use" in report.to_markdown()
