"""benchmarks/profile_tree_sizes.py on the tiny target, so the profile behind docs/BENCHMARKS.md cannot rot."""

from __future__ import annotations

import torch

from benchmarks import profile_tree_sizes
from taps_ray.config import TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec import decoder, verify


def test_tree_sizes_times_each_step_by_its_size_and_restores_the_decoder(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    drafter = DraftHead(tiny_target.config, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, tiny_target.vocab_size, (12,), generator=generator) for _ in range(3)]
    sizes = profile_tree_sizes.tree_sizes(tiny_target, drafter, TreeConfig(), prompts, 24)
    assert sizes and all(entry["steps"] > 0 for entry in sizes.values())
    assert 1 in sizes and sizes[1]["_plain_step"] > 0
    trees = {size: entry for size, entry in sizes.items() if size > 1}
    assert trees, "the budget's probes draft some steps"
    for entry in trees.values():
        assert entry["run_tree"] > 0 and entry["verify_greedy"] > 0 and entry["compact_target"] > 0
    assert decoder.run_tree is verify.run_tree and decoder.compact_target is verify.compact_target
    assert decoder._plain_step.__module__ == decoder.__name__


def test_products_time_every_format_at_every_row_count():
    times = profile_tree_sizes.products(64, 128, torch.bfloat16, [1, 5], calls=10)
    assert set(times) == {"int4", "int8", "dense"}
    assert all(set(per) == {1, 5} and all(us > 0 for us in per.values()) for per in times.values())
    assert set(profile_tree_sizes.products(64, 128, torch.float32, [2], calls=10)) == {"dense"}
