"""Cost of one batched verification forward: B requests x n tree nodes each, on prefixes of P tokens.

    python benchmarks/bench_batch_forward.py configs/demo.yaml [overrides ...] [--requests 1,2,4,8,16] \
        [--nodes 1,4,8,16,24] [--prefix 300] [--threads 1] [--repeat 5] [--attention] [--compare-sdpa] \
        [--out runs/bench/batch_forward.json]

For every (B, n): B caches of ``--prefix`` tokens, each verifying an n-node chain (its own causal
mask), run through :func:`taps_ray.spec.batch.forward_batch` (``--repeat`` times, median wall time,
caches cropped back between runs). Prints ms per forward and per request; the ratio to B = 1, n = 1
is what one step of plain decoding costs. ``--threads`` sets torch's intra-op threads (a 1-CPU Serve
replica runs with one). ``--attention`` (static engine) also times the share of each forward spent in the
per-request attention calls (``StaticEngine._attend``, one per request and layer) and the one-token kernel's
(``models/decode_attention.py``, one a layer), and, for one-token steps, one batched
``scaled_dot_product_attention`` a layer over the requests' keys padded to a common length, with how many of its
rows equal their request's own attention bit for bit. ``--compare-sdpa`` times every forward twice, alternating:
with the one-token kernel and with it off (every request through SDPA), and prints both.
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
    parser.add_argument("--attention", action="store_true", help="time the per-request attention calls too")
    parser.add_argument("--compare-sdpa", action="store_true", help="also time each forward with the kernel off")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from taps_ray.config import load_config
    from taps_ray.models import decode_attention
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
    engine = target.engine
    attend_s = [0.0]
    if args.attention:
        if engine is None:
            parser.error("--attention needs the static engine (target.engine: auto on a supported family)")
        _time_calls(engine, "_attend", attend_s)
        _time_calls(decode_attention.DecodeAttention, "__call__", attend_s)
    kernel_library = decode_attention.attention_library
    modes = ("kernel", "sdpa") if args.compare_sdpa else ("kernel",)
    rows = []
    for n in nodes:
        tokens = torch.randint(0, target.vocab_size, (n,), generator=g)
        positions = torch.arange(args.prefix, args.prefix + n)
        for b in requests:
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            attention: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.repeat + 1):
                for mode in modes:
                    decode_attention.attention_library = kernel_library if mode == "kernel" else lambda: None
                    calls = [ForwardCall(tokens, positions, caches[i]) for i in range(b)]
                    attend_s[0] = 0.0
                    start = time.perf_counter()
                    forward_batch(target, calls)
                    times[mode].append(time.perf_counter() - start)
                    attention[mode].append(attend_s[0])
                    for cache in caches[:b]:
                        crop_cache(cache, args.prefix)
            decode_attention.attention_library = kernel_library
            ms = 1000 * statistics.median(times["kernel"][1:])
            row = {"requests": b, "nodes": n, "ms": round(ms, 2), "ms_per_request": round(ms / b, 2)}
            line = f"B={b:2d} n={n:2d}: {ms:7.1f} ms per forward, {ms / b:6.1f} ms per request"
            if args.compare_sdpa:
                row["sdpa_ms"] = round(1000 * statistics.median(times["sdpa"][1:]), 2)
                line += f" (kernel off: {row['sdpa_ms']:7.1f} ms)"
            if args.attention:
                row["attention_ms"] = round(1000 * statistics.median(attention["kernel"][1:]), 2)
                line += f", {row['attention_ms']:7.1f} ms in attention"
                if args.compare_sdpa:
                    row["sdpa_attention_ms"] = round(1000 * statistics.median(attention["sdpa"][1:]), 2)
                    line += f" (kernel off: {row['sdpa_attention_ms']:.1f} ms)"
                if n == 1 and b > 1:
                    row["batched_attention_ms"], row["batched_rows_bitwise"] = _batched_attention(engine, caches[:b],
                                                                                                args.repeat)
                    line += (f" (one batched SDPA call a layer: {row['batched_attention_ms']:.1f} ms, "
                             f"{row['batched_rows_bitwise']}/{b} rows bitwise)")
            rows.append(row)
            print(line, flush=True)
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


def _time_calls(owner, name: str, total: list[float]) -> None:
    """Add the seconds of every call of ``owner.name`` to ``total[0]``."""
    own = getattr(owner, name)

    def timed(*a, **k):
        start = time.perf_counter()
        out = own(*a, **k)
        total[0] += time.perf_counter() - start
        return out

    setattr(owner, name, timed)


def _batched_attention(engine, caches, repeat: int) -> tuple[float, int]:
    """Milliseconds of one ``scaled_dot_product_attention`` a layer (all layers) over one query per cache against
    the caches' keys padded to the longest (a key mask), and how many rows equal that cache's own call."""
    import torch
    import torch.nn.functional as F

    lengths = [c.length for c in caches]
    longest, layers = max(lengths), len(engine.layers)
    dtype = caches[0].keys.dtype
    g = torch.Generator().manual_seed(1)
    query = torch.randn(len(caches), engine.heads, 1, engine.head_dim, generator=g).to(dtype)
    keys = torch.zeros(layers, len(caches), engine.kv_heads, longest, engine.head_dim, dtype=dtype)
    values = torch.zeros_like(keys)
    for i, cache in enumerate(caches):
        keys[:, i, :, :cache.length] = cache.keys[:, :, :cache.length]
        values[:, i, :, :cache.length] = cache.values[:, :, :cache.length]
    mask = torch.zeros(len(caches), 1, 1, longest, dtype=dtype)
    for i, length in enumerate(lengths):
        mask[i, ..., length:] = float("-inf")
    gqa = engine.heads != engine.kv_heads
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        for layer in range(layers):
            out = F.scaled_dot_product_attention(query, keys[layer], values[layer], attn_mask=mask, scale=engine.scale,
                                                 enable_gqa=gqa)
        times.append(time.perf_counter() - start)
    same = sum(torch.equal(out[i:i + 1], F.scaled_dot_product_attention(
        query[i:i + 1], keys[-1, i:i + 1, :, :length], values[-1, i:i + 1, :, :length], scale=engine.scale,
        enable_gqa=gqa)) for i, length in enumerate(lengths))
    return round(1000 * statistics.median(times[1:]), 2), int(same)


if __name__ == "__main__":
    sys.exit(main())
