"""Cost of one batched verification forward: B requests x n tree nodes each, on prefixes of P tokens.

    python benchmarks/bench_batch_forward.py configs/demo.yaml [overrides ...] [--requests 1,2,4,8,16] \
        [--nodes 1,4,8,16,24] [--prefix 300] [--threads 1] [--repeat 5] [--out runs/bench/batch_forward.json]

For every (B, n): B caches of ``--prefix`` tokens, each verifying an n-node chain (its own causal
mask), run through :func:`taps_ray.spec.batch.forward_batch` (``--repeat`` times, median wall time,
caches cropped back between runs). Prints ms per forward and per request; the ratio to B = 1, n = 1
is what one step of plain decoding costs. ``--threads`` sets torch's intra-op threads (a 1-CPU Serve
replica runs with one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--requests", default="1,2,4,8,16")
    parser.add_argument("--nodes", default="1,4,8,16,24")
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from taps_ray.config import load_config
    from taps_ray.models.target import TargetModel
    from taps_ray.models.target_cache import crop_cache
    from taps_ray.spec.batch import ForwardCall, forward_batch

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    target = TargetModel.load(cfg.target)
    requests = [int(b) for b in args.requests.split(",")]
    nodes = [int(n) for n in args.nodes.split(",")]
    g = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(max(requests)):
        cache = target.new_cache()
        target.prefill(torch.randint(0, target.vocab_size, (1, args.prefix), generator=g), cache)
        caches.append(cache)
    rows = []
    for n in nodes:
        tokens = torch.randint(0, target.vocab_size, (n,), generator=g)
        positions = torch.arange(args.prefix, args.prefix + n)
        for b in requests:
            times = []
            for _ in range(args.repeat + 1):
                calls = [ForwardCall(tokens, positions, caches[i]) for i in range(b)]
                start = time.perf_counter()
                forward_batch(target, calls)
                times.append(time.perf_counter() - start)
                for cache in caches[:b]:
                    crop_cache(cache, args.prefix)
            ms = 1000 * statistics.median(times[1:])
            rows.append({"requests": b, "nodes": n, "ms": round(ms, 2), "ms_per_request": round(ms / b, 2)})
            print(f"B={b:2d} n={n:2d}: {ms:7.1f} ms per forward, {ms / b:6.1f} ms per request", flush=True)
    base = next(r["ms"] for r in rows if r["requests"] == 1 and r["nodes"] == 1) if 1 in requests and 1 in nodes \
        else None
    out = {"config": args.config, "overrides": args.overrides, "dtype": str(target.dtype), "prefix": args.prefix,
           "threads": args.threads, "repeat": args.repeat, "rows": rows,
           "relative_to_one_token": None if base is None else {f"B={r['requests']},n={r['nodes']}": round(r["ms"] / base, 2)
                                                               for r in rows}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
