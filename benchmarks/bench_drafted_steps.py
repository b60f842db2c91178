"""What drafting costs per drafted step in real decoding, by the depth the tree budget chose and by the tokens the
drafter had to catch up on (those appended since it last drafted: after a run of plain steps, more).

    python benchmarks/bench_drafted_steps.py configs/demo.yaml [overrides ...] [--drafter release:chat] \
        [--benchmark mt_bench] [--limit 10] [--max-new-tokens 128]

Decodes ``limit`` first turns of ``benchmark`` greedily with the drafter and the production tree budget (one
budget for all prompts, as a served strategy keeps one), timing each call of the strategy's ``propose`` (drafting
and prompt lookup, not the budget's choice). A request's first drafted step also runs its prompt (and any plain
steps before it) through the drafter and is counted apart. Prints the median and mean milliseconds per (depth, tokens queued) cell.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

QUEUED_BINS = ((1, "1"), (3, "2-3"), (8, "4-8"), (10**9, "9+"))


def _queued_bin(queued: int) -> str:
    return next(label for bound, label in QUEUED_BINS if queued <= bound)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--drafter", default="release:chat")
    parser.add_argument("--benchmark", default="mt_bench")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    import torch

    from taps_ray.config import load_config
    from taps_ray.eval.bench import benchmark_prompts
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.cost import TreeBudget
    from taps_ray.spec.decoder import generate, load_drafter_source
    from taps_ray.spec.protocol import SingleStrategy

    cfg = load_config(args.config, args.overrides)
    target = TargetModel.load(cfg.target)
    torch.set_num_threads(cfg.target.threads or torch.get_num_threads())
    head = load_drafter_source(target, "drafter", args.drafter)

    class TimedStrategy(SingleStrategy):
        """Times each ``propose``, noting the depth asked and the tokens queued since the last one."""

        def __init__(self, *a):
            super().__init__(*a)
            self.queued, self.drafted = 0, False
            self.calls: list[tuple[int | None, int | None, float]] = []

        def start(self, target, tokens, features):
            super().start(target, tokens, features)
            self.queued, self.drafted = 0, False

        def advance(self, tokens, features):
            super().advance(tokens, features)
            self.queued += int(tokens.numel())

        def propose(self, state):
            start = time.perf_counter()
            tree = super().propose(state)
            self.calls.append((state.depth, self.queued if self.drafted else None, time.perf_counter() - start))
            self.queued, self.drafted = 0, True
            return tree

    budget = TreeBudget()
    calls: list[tuple[int | None, int | None, float]] = []
    for prompt in benchmark_prompts(target, args.benchmark, args.limit):
        strategy = TimedStrategy(head, cfg.tree)
        generate(target, prompt, strategy, None, args.max_new_tokens, budget=budget)
        calls += strategy.calls
    first = [s for _, queued, s in calls if queued is None]
    cells: dict[tuple[str, str], list[float]] = {}
    for depth, queued, seconds in calls:
        if queued is not None:
            cells.setdefault((str(cfg.tree.depth) + " (configured)" if depth is None else str(depth),
                              _queued_bin(queued)), []).append(seconds)
    print(f"{args.drafter} on {args.limit} {args.benchmark} prompts, {args.max_new_tokens} tokens, "
          f"{torch.get_num_threads()} thread(s): {len(calls)} drafted steps")
    if first:
        print(f"first of a request (the prompt through the drafter): {len(first)} steps, median "
              f"{1e3 * statistics.median(first):.1f} ms")
    print("depth | tokens queued | steps | median ms | mean ms")
    for (depth, queued), seconds in sorted(cells.items()):
        print(f"{depth} | {queued} | {len(seconds)} | {1e3 * statistics.median(seconds):.1f} | "
              f"{1e3 * statistics.mean(seconds):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
