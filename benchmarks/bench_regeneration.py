"""Regeneration throughput: the regeneration actor's batched decode with the release drafter under the
cost-model budget against plain batched decoding, on the same prompts, alternating, in one process.

    python benchmarks/bench_regeneration.py [--prompts 16] [--max-new-tokens 64] [--rounds 2]

Prints tokens/s per round and how many of the budget's decisions were plain steps; the answers of both
are checked equal (the decoder is lossless either way).
"""

from __future__ import annotations

import argparse
import json
import time

from taps_ray.config import RegenerationConfig, TargetConfig
from taps_ray.data.features import RegenerateActor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts decoded together (one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
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
            print(f"round {round_} drafter {drafter or 'none'}: {actor.tokens} tokens in {seconds:.1f} s, "
                  f"{actor.tokens / seconds:.1f} tok/s; budget decisions {len(decisions)}, "
                  f"plain {sum(n == 1 for n in decisions)}", flush=True)
    print("answers identical:", answers["auto"] == answers[None])


if __name__ == "__main__":
    main()
