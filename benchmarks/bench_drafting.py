"""What one drafting call costs: the drafter's forward (its linears as ``F.linear`` or oneDNN-packed) and the
draft head in each format, per row count, on the default target and drafter.

    python benchmarks/bench_drafting.py configs/demo.yaml [overrides ...] [--drafter release:math] \
        [--rows 1,3,8] [--prefix 120] [--calls 20] [--rounds 8] [--head-rows N] [--in-situ] [--out runs/bench/drafting.json]

The variants of each measurement alternate round by round in one process (so a neighbour's burst slows them
alike); the figure is the 10th percentile of ``rounds x calls`` timed calls, in milliseconds. Head kinds
(:class:`~taps_ray.spec.draft_compute.DraftHeadProduct`): ``dense`` (``rows @ hidden^T``), ``packed`` where the
engine packs its products, ``int4`` for a bf16 target on CPU. ``--in-situ`` runs one plain target step before
each timed call, as decoding does, so the drafter's weights are read from where a target step leaves them rather
than from a cache warmed by the call before.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _percentile(samples: list[float], q: float = 0.1) -> float:
    ordered = sorted(samples)
    return 1e3 * ordered[int(q * (len(ordered) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--drafter", default="release:math")
    parser.add_argument("--rows", default="1,3,8")
    parser.add_argument("--prefix", type=int, default=120)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--head-rows", type=int, default=None,
                        help="time the heads over the first N rows of the target head (a draft vocabulary's size)")
    parser.add_argument("--in-situ", action="store_true",
                        help="one plain target step before each timed call (the caches as in decoding)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from taps_ray.config import load_config
    from taps_ray.models.engine import can_pack, read_linears_packed
    from taps_ray.models.target import TargetModel
    from taps_ray.models.target_cache import crop_cache
    from taps_ray.spec.decoder import load_drafter
    from taps_ray.spec.draft_compute import DraftHeadProduct

    cfg = load_config(args.config, args.overrides)
    target = TargetModel.load(cfg.target)
    torch.set_num_threads(cfg.target.threads or torch.get_num_threads())
    rows = [int(r) for r in args.rows.split(",")]
    drafters = {"F.linear": load_drafter(target, args.drafter), "packed": load_drafter(target, args.drafter)}
    dtype = drafters["F.linear"].fc.weight.dtype
    if can_pack(target.device, dtype):
        read_linears_packed(drafters["packed"])
    else:
        del drafters["packed"]
    weight = target.lm_head.weight.detach()[:args.head_rows]
    kinds = ["dense", *(["packed"] if can_pack(target.device, weight.dtype) else []),
             *(["int4"] if target.device.type == "cpu" and weight.dtype == torch.bfloat16 else [])]
    heads = {kind: DraftHeadProduct(weight, kind) for kind in kinds}
    hidden_size = target.hidden_size
    caches = {}
    with torch.inference_mode():
        target_cache = target.new_cache(args.prefix + 8)
        target.prefill(torch.arange(2, 2 + args.prefix)[None] % target.vocab_size, target_cache)
        step_token = torch.full((1, 1), 7, dtype=torch.long)
        step_position = torch.full((1, 1), args.prefix, dtype=torch.long)

        def target_step() -> None:
            if args.in_situ:
                target.forward(step_token, step_position, target_cache)
                crop_cache(target_cache, args.prefix)

        for name, drafter in drafters.items():
            cache = drafter.new_cache()
            warm = torch.randn(1, args.prefix, hidden_size, dtype=dtype)
            drafter(warm, warm, torch.arange(args.prefix)[None], cache, None)
            caches[name] = cache
        forward_s = {name: {n: [] for n in rows} for name in drafters}
        head_s = {kind: {n: [] for n in rows} for kind in heads}
        for _ in range(args.rounds):
            for n in rows:
                x = torch.randn(1, n, hidden_size, dtype=dtype)
                positions = torch.arange(args.prefix, args.prefix + n)[None]
                for name, drafter in drafters.items():
                    for _ in range(args.calls):
                        target_step()
                        start = time.perf_counter()
                        drafter(x, x, positions, caches[name], None)
                        forward_s[name][n].append(time.perf_counter() - start)
                        caches[name].crop(-n)
                for kind, head in heads.items():
                    for _ in range(args.calls):
                        target_step()
                        start = time.perf_counter()
                        head(x[0])
                        head_s[kind][n].append(time.perf_counter() - start)
    result = {"drafter": args.drafter, "head_rows": weight.shape[0], "dtype": str(dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "prefix": args.prefix, "in_situ": args.in_situ,
              "forward_ms": {name: {n: round(_percentile(v), 3) for n, v in per.items()} for name, per in forward_s.items()},
              "head_ms": {kind: {n: round(_percentile(v), 3) for n, v in per.items()} for kind, per in head_s.items()}}
    print(f"drafter {args.drafter} ({result['dtype']}, {result['threads']} threads), after {args.prefix} cached "
          f"positions{', a target step before each call' if args.in_situ else ''}; ms, 10th percentile of {args.rounds * args.calls} calls")
    print("rows | " + " | ".join([f"forward {n}" for n in result["forward_ms"]] + [f"head {k}" for k in result["head_ms"]]))
    for n in rows:
        cells = [result["forward_ms"][name][n] for name in result["forward_ms"]] + \
                [result["head_ms"][kind][n] for kind in result["head_ms"]]
        print(f"{n} | " + " | ".join(f"{c:.3f}" for c in cells))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
