"""Decoding on a Serve replica's worker thread: torch threads and glibc malloc arenas.

    python benchmarks/bench_replica_threads.py configs/demo.yaml \
        'serve.drafters={math: runs/demo/drafters/hass-math}' [--prompts 3] [--out runs/bench/replica_threads.json]

A plain Ray actor (1 CPU, as a Serve replica gets) decodes the same prompts with the served
strategy (``single``, the first drafter) in-process, for torch threads 1 and 2, on the actor's main
thread and on a worker thread (where Serve runs replica methods), once with glibc's default malloc
arenas and once with ``MALLOC_ARENA_MAX=1``. Reports tokens/s and the mean draft and verify
milliseconds per step: what the Verifier (one CPU, so Ray's ``OMP_NUM_THREADS=1``, on a worker
thread) pays against decoding on a main thread with every core.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_test import PROMPTS  # noqa: E402


class Decoder:
    """Ray actor body: the config's target and first served drafter, decoding greedily."""

    def __init__(self, config: str, overrides: list[str]):
        from taps_ray.config import load_config
        from taps_ray.models.target import TargetModel
        from taps_ray.spec.decoder import load_drafter
        from taps_ray.spec.protocol import SingleStrategy

        cfg = load_config(config, overrides)
        self.target = TargetModel.load(cfg.target)
        served = next(iter(cfg.serve.drafters.values()))
        self.strategy = SingleStrategy(load_drafter(self.target, served.checkpoint, served.seed), cfg.tree)

    def measure(self, threads: int, worker_thread: bool, prompts: list[str], max_tokens: int) -> dict:
        out: dict = {}

        def body() -> None:
            import torch

            from taps_ray.spec.decoder import generate

            torch.set_num_threads(threads)
            generate(self.target, [{"role": "user", "content": prompts[0]}], self.strategy, max_new_tokens=8)
            seconds = tokens = 0.0
            records = []
            for prompt in prompts:
                start = time.perf_counter()
                result = generate(self.target, [{"role": "user", "content": prompt}], self.strategy,
                                  max_new_tokens=max_tokens)
                seconds += time.perf_counter() - start
                tokens += len(result.token_ids)
                records += result.steps
            out.update(tokens_per_s=tokens / seconds, draft_ms=1e3 * sum(r.draft_s for r in records) / len(records),
                       verify_ms=1e3 * sum(r.verify_s for r in records) / len(records), steps=len(records))

        if worker_thread:
            thread = threading.Thread(target=body)
            thread.start()
            thread.join()
        else:
            body()
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from taps_ray.runtime.cluster import init_ray

    ray = init_ray()
    prompts = PROMPTS[1:1 + args.prompts]
    rows = []
    print("| malloc arenas | torch threads | runs on | tok/s | draft ms/step | verify ms/step |\n|---|---:|---|---:|---:|---:|")
    for env in ({}, {"MALLOC_ARENA_MAX": "1"}):
        runtime_env = {"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent), **env}}
        actor = ray.remote(num_cpus=1)(Decoder).options(runtime_env=runtime_env).remote(args.config, args.overrides)
        for threads in (1, 2):
            for worker_thread in (False, True):
                row = {"malloc_arena_max": env.get("MALLOC_ARENA_MAX", "default"), "threads": threads,
                       "runs_on": "worker thread" if worker_thread else "main thread",
                       **ray.get(actor.measure.remote(threads, worker_thread, prompts, args.max_tokens))}
                rows.append(row)
                print(f"| {row['malloc_arena_max']} | {threads} | {row['runs_on']} | {row['tokens_per_s']:.2f} | "
                      f"{row['draft_ms']:.1f} | {row['verify_ms']:.1f} |", flush=True)
        ray.kill(actor)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": args.config, "overrides": args.overrides, "rows": rows},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
