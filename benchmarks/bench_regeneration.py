"""Regeneration throughput: the regeneration actor's batched decode with the release drafter under the
cost-model budget against plain batched decoding, on the same prompts, alternating, in one process.

    python benchmarks/bench_regeneration.py [--prompts 16] [--max-new-tokens 64] [--rounds 2] [--never-draft]

Prints tokens/s per round, how many of the budget's decisions were plain steps, the batched target forwards and
the steps that verified a drafted tree; the answers of both are checked equal (the decoder is lossless either way).
``--never-draft``: the drafter is loaded but its budget never drafts (what the drafting machinery costs around
plain steps).
"""

from __future__ import annotations

import argparse
import json
import time

from taps_ray.config import RegenerationConfig, TargetConfig
from taps_ray.data.features import RegenerateActor
from taps_ray.spec import batch as batch_module
from taps_ray.spec.cost import TreeBudget


def recording(generate_together, seen: list):
    """``generate_together`` that also appends its results and batcher to ``seen``."""
    def run(*args, **kwargs):
        results, batcher = generate_together(*args, **kwargs)
        seen.append((results, batcher))
        return results, batcher
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts decoded together (one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--never-draft", action="store_true", help="load the drafter, but never draft")
    args = parser.parse_args()
    if args.never_draft:
        TreeBudget.should_draft = lambda self, others=(): False
    seen: list = []
    batch_module.generate_together = recording(batch_module.generate_together, seen)
    questions = [f"Tom has {i + 3} apples and buys {2 * i + 5} more, then gives away {i + 1}. How many apples "
                 "does he have now? Explain step by step." for i in range(args.prompts)]
    batch = {"row_id": list(range(args.prompts)),
             "messages": [json.dumps([{"role": "user", "content": q}]) for q in questions]}
    answers = {}
    for round_ in range(args.rounds):
        for drafter in ("auto", None):
            actor = RegenerateActor(TargetConfig().model_dump(),
                                    RegenerationConfig(max_new_tokens=args.max_new_tokens, drafter=drafter).model_dump())
            start = time.perf_counter()
            out = actor(batch)
            seconds = time.perf_counter() - start
            answers.setdefault(drafter, list(out["response"]))
            decisions = list(actor.budget.chosen)
            results, batcher = seen[-1]
            drafted = sum(step.tree_size > 1 for result in results for step in result.steps)
            print(f"round {round_} drafter {drafter or 'none'}: {actor.tokens} tokens in {seconds:.1f} s, "
                  f"{actor.tokens / seconds:.1f} tok/s; budget decisions {len(decisions)}, "
                  f"plain {sum(n == 1 for n in decisions)}; forwards {sum(batcher.sizes.values())}, "
                  f"drafted steps {drafted}", flush=True)
    print("answers identical:", answers["auto"] == answers[None])


if __name__ == "__main__":
    main()
