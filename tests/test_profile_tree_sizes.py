"""benchmarks/profile_tree_sizes.py on the tiny target, so the profile behind docs/BENCHMARKS.md cannot rot."""

from __future__ import annotations

import torch

from benchmarks import profile_tree_sizes
from taps_ray.config import TreeConfig
from taps_ray.spec import decoder, verify
from tests.spec.spec_helpers import bigram_target, oracle_drafter, random_prompt


def test_tree_sizes_times_each_step_by_its_size_and_restores_the_decoder(tmp_path, monkeypatch):
    """The config's tree at every step (no budget, so nothing depends on this machine's timings): every step but
    the ones cut at the token limit verifies the whole tree."""
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    target = bigram_target(0)
    prompts = [random_prompt(target, 12, seed) for seed in range(3)]
    tree = TreeConfig(depth=2, top_k=3, total_tokens=8, lookup_tokens=0, adaptive=False)
    sizes = profile_tree_sizes.tree_sizes(target, oracle_drafter(target), tree, prompts, 24, adaptive=False)
    assert sizes and all(entry["steps"] > 0 for entry in sizes.values())
    trees = {size: entry for size, entry in sizes.items() if size > 1}
    assert max(trees, key=lambda size: trees[size]["steps"]) == 8
    for entry in trees.values():
        assert entry["run_tree"] > 0 and entry["verify_greedy"] > 0 and entry["compact_target"] > 0
    assert decoder.run_tree is verify.run_tree and decoder.compact_target is verify.compact_target
    assert decoder._plain_step.__module__ == decoder.__name__


def test_products_time_every_format_at_every_row_count():
    times = profile_tree_sizes.products(64, 128, torch.bfloat16, [1, 5], calls=10)
    assert set(times) == {"int4", "int8", "dense", "dense-packed"}
    assert all(set(per) == {1, 5} and all(us > 0 for us in per.values()) for per in times.values())
    assert set(profile_tree_sizes.products(64, 128, torch.float32, [2], calls=10)) == {"dense", "dense-packed"}
