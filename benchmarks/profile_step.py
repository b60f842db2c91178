"""Where a speculative step's time goes, next to a vanilla step, on the default target and dtype.

    python benchmarks/profile_step.py configs/demo.yaml [target.dtype=float32] --drafter DIR --limit 3

Decodes each prompt greedily twice (vanilla, then one drafter with the config's tree) through the
core's own functions, timing each part of every step with wall clock: drafting, tree attention
inputs, the target's layers, the LM head (logits), acceptance, cache compaction, and the rest of
the step (Python and bookkeeping). Prints mean milliseconds per step and the break-even tau
(spec step / vanilla step): the drafter's tau must exceed it for speculation to pay.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch

from taps_ray.config import load_config
from taps_ray.eval.bench import benchmark_prompts
from taps_ray.models.target import TargetModel
from taps_ray.spec.decoder import load_drafter
from taps_ray.spec.tree import DrafterState, draft_tree
from taps_ray.spec.verify import compact_target, tree_attention, verify_greedy


class Clock:
    """Accumulates wall milliseconds per part."""

    def __init__(self):
        self.ms: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.ms[part] += 1e3 * (now - self._last)
        self._last = now

    def per_step(self) -> dict[str, float]:
        return {part: round(ms / max(1, self.steps), 2) for part, ms in self.ms.items()}


@torch.inference_mode()
def target_forward(target: TargetModel, tokens, positions, cache, mask, clock: Clock):
    hidden = target.forward_hidden(tokens, positions, cache, mask)
    clock.lap("target layers")
    logits = target.logits(hidden)
    clock.lap("lm head")
    return hidden, logits


@torch.inference_mode()
def vanilla(target: TargetModel, ids: torch.Tensor, max_new_tokens: int, clock: Clock) -> None:
    cache = target.new_cache()
    _, logits = target_forward(target, ids[None], torch.arange(ids.numel())[None], cache, None, Clock())
    token = logits[0, -1].argmax()
    position = ids.numel()
    clock._last = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        _, logits = target_forward(target, token.view(1, 1), torch.tensor([[position]]), cache, None, clock)
        token = logits[0, -1].argmax()
        position += 1
        clock.lap("acceptance")
        clock.steps += 1


@torch.inference_mode()
def speculative(target: TargetModel, drafter, tree_cfg, ids: torch.Tensor, max_new_tokens: int, clock: Clock) -> int:
    """Returns the number of tokens the steps produced (the prefill token not counted)."""
    cache = target.new_cache()
    hidden, logits = target_forward(target, ids[None], torch.arange(ids.numel())[None], cache, None, Clock())
    tokens = torch.cat([ids, logits[0, -1].argmax()[None]])
    state = DrafterState(drafter)
    state.add(tokens[1:], hidden[0])
    clock._last = time.perf_counter()
    while tokens.numel() - ids.numel() < max_new_tokens:
        tree = draft_tree(drafter, target, state, tree_cfg)
        clock.lap("drafting")
        mask, positions = tree_attention(tree, target.dtype)
        clock.lap("tree mask")
        hidden, logits = target_forward(target, tree.tokens[None], positions, cache, mask, clock)
        verdict = verify_greedy(tree, logits[0])
        clock.lap("acceptance")
        compact_target(cache, tree, verdict)
        clock.lap("cache compaction")
        tokens = torch.cat([tokens, verdict.tokens])
        state.add(verdict.tokens, hidden[0, verdict.path])
        clock.lap("other")
        clock.steps += 1
    return tokens.numel() - ids.numel() - 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. target.dtype=float32")
    parser.add_argument("--drafter", default=None, help="folder or release:NAME (default: untrained)")
    parser.add_argument("--benchmark", default="gsm8k")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    target = TargetModel.load(cfg.target)
    drafter = load_drafter(target, args.drafter)
    prompts = benchmark_prompts(target, args.benchmark, args.limit)
    plain, spec = Clock(), Clock()
    produced = 0
    for ids in prompts:
        vanilla(target, ids, args.max_new_tokens, plain)
        produced += speculative(target, drafter, cfg.tree, ids, args.max_new_tokens, spec)
    plain_ms, spec_ms = sum(plain.per_step().values()), sum(spec.per_step().values())
    print(json.dumps({
        "target": target.name, "dtype": target.dtype_note, "threads": torch.get_num_threads(),
        "drafter": args.drafter or "untrained", "tree": cfg.tree.model_dump(),
        "vanilla_ms_per_step": plain.per_step(), "vanilla_step_ms": round(plain_ms, 2),
        "spec_ms_per_step": spec.per_step(), "spec_step_ms": round(spec_ms, 2),
        "tau": round(produced / max(1, spec.steps), 3), "break_even_tau": round(spec_ms / plain_ms, 3),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
