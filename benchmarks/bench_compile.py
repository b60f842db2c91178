"""Do compiled steps (``target.compile``, :mod:`taps_ray.models.compiled`) pay on this machine? One request's
steps of each row count, eager and compiled alternately on the same cache, on the config's target.

    python benchmarks/bench_compile.py configs/demo.yaml [--rows 1,4,8] [--steps 100] [KEY=VALUE ...]

After a prefill of ``--prefix`` tokens, each step runs ``rows`` tokens (a causal chain, as a tree's nodes are
verified) through the target's layers and LM head, then crops the cache back so that it grows by one entry
a step, as decoding does; steps alternate between the eager forward and the compiled one, so a drift in the
machine's speed reaches both alike. Prints the compile seconds of each new graph (kept out of the timings),
then per row count the median ms of an eager and a compiled step and their ratio (tests/models/test_compiled.py
checks that the two agree).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from taps_ray.config import load_config
from taps_ray.models.target import TargetModel
from taps_ray.models.target_cache import Segment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--steps", type=int, default=100, help="steps per row count, half of them compiled")
    parser.add_argument("--prefix", type=int, default=120, help="cached tokens before the first step")
    parser.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE (target.compile is set on)")
    args = parser.parse_args()
    cfg = load_config(args.config, [*args.overrides, "target.compile=true"])
    target = TargetModel.load(cfg.target)
    engine = target.engine
    compiled = engine.compiled
    print(f"target {target.name}, {target.precision}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    prompt = torch.arange(1000, 1000 + args.prefix)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            cache = target.new_cache(args.prefix + args.steps + rows)
            engine.forward(prompt, torch.arange(args.prefix), [Segment(cache, args.prefix)])
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            token = torch.tensor(42)
            for step in range(args.steps + 2):
                tokens = token.repeat(rows)
                positions = torch.arange(cache.length, cache.length + rows)
                name = "compiled" if step % 2 else "eager"
                engine.compiled = compiled if step % 2 else None
                before, start = compiled.compile_s, time.perf_counter()
                logits = target.logits(engine.forward(tokens, positions, [Segment(cache, rows)]))
                seconds = time.perf_counter() - start
                if compiled.compile_s > before:
                    print(f"rows {rows}: compiled a graph in {compiled.compile_s - before:.1f} s")
                elif step >= 2:
                    times[name].append(seconds)
                cache.crop(cache.length - rows + 1)
                token = logits[-1].argmax()
            engine.compiled = compiled
            eager, fast = (1e3 * statistics.median(times[k]) for k in ("eager", "compiled"))
            print(f"rows {rows}: eager {eager:.2f} ms, compiled {fast:.2f} ms ({eager / fast:.2f}x)")


if __name__ == "__main__":
    main()
