"""What a verification costs by the tree size the cost model picks, and what one layer product costs by row count.

    python benchmarks/profile_tree_sizes.py configs/demo.yaml [overrides ...] [--drafter release:math] \
        [--limit 6] [--max-new-tokens 128] [--rows 1,2,4,5,8,12,16] [--out runs/bench/tree_sizes.json]

Decodes ``--limit`` prompts of the ``taps bench`` draw greedily with the drafter and the cost-model trees (one
:class:`~taps_ray.spec.cost.TreeBudget` across the prompts, as ``taps bench`` keeps it), timing each step's target
forward (``run_tree``; a plain step's ``_plain_step``, size 1), acceptance and cache compaction by tree size: mean milliseconds and the number of steps.
Then times one product of a decoder layer's gate/up shape (``[rows, H] x [I, H]^T``) by row count in the formats
torch offers on this CPU: int4 codes, int8 weights, dense ``F.linear`` in the target's dtype and the engine's
oneDNN-prepacked dense product (:class:`~taps_ray.models.engine.Linear`; AMX tiles where the CPU has them) (the
10th percentile of ``--calls`` calls, microseconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from taps_ray.config import load_config
from taps_ray.eval.bench import benchmark_prompts
from taps_ray.models.engine import Linear, can_pack
from taps_ray.models.target import TargetModel
from taps_ray.runstate import write_json
from taps_ray.spec import decoder
from taps_ray.spec.cost import TreeBudget, cost_model
from taps_ray.spec.decoder import generate, load_drafter
from taps_ray.spec.protocol import SingleStrategy

TIMED = {"_plain_step": lambda args: 1, "run_tree": lambda args: args[1].size,
         "verify_greedy": lambda args: args[0].size, "compact_target": lambda args: args[1].size}
"""The decoder functions timed, and how each call's tree size is read from its arguments (a plain step: 1)."""


def _timed(parts: dict, name: str, call):
    """``call`` wrapped to add its seconds to ``parts[(name, tree size)]``."""
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        parts[(name, TIMED[name](args))].append(time.perf_counter() - start)
        return out
    return wrapped


def tree_sizes(target: TargetModel, drafter, tree_cfg, prompts: list[torch.Tensor], max_new_tokens: int,
               adaptive: bool = True) -> dict:
    """Per tree size: steps and mean ms of each :data:`TIMED` part, over ``prompts`` (after one warm-up); the
    tree sized each step by a cost-model budget, or ``tree_cfg``'s own tree at every step (``adaptive=False``)."""
    budget = TreeBudget(cost_model(target)) if adaptive else None
    parts: dict[tuple[str, int], list[float]] = defaultdict(list)
    originals = {name: getattr(decoder, name) for name in TIMED}
    with torch.inference_mode():
        generate(target, prompts[0], SingleStrategy(drafter, tree_cfg), None, 32, budget=budget)
        try:
            for name, call in originals.items():
                setattr(decoder, name, _timed(parts, name, call))
            for ids in prompts:
                generate(target, ids, SingleStrategy(drafter, tree_cfg), None, max_new_tokens, budget=budget)
        finally:
            for name, call in originals.items():
                setattr(decoder, name, call)
    sizes = sorted({size for _, size in parts})
    forward = {1: "_plain_step"}
    return {size: {"steps": len(parts[(forward.get(size, "run_tree"), size)]),
                   **{name: round(1e3 * sum(parts[(name, size)]) / len(parts[(name, size)]), 2)
                      for name in TIMED if parts[(name, size)]}} for size in sizes}


def _p10_us(product, x: torch.Tensor, calls: int) -> float:
    for _ in range(10):
        product(x)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        product(x)
        seconds.append(time.perf_counter() - start)
    return round(1e6 * sorted(seconds)[calls // 10], 1)


def products(hidden: int, inner: int, dtype: torch.dtype, rows: list[int], calls: int) -> dict:
    """Microseconds of one ``[rows, hidden] x [inner, hidden]^T`` product per format and row count (random
    weights: the kernels' speed does not depend on the values)."""
    weight = torch.randn(inner, hidden, dtype=dtype)
    packed = Linear(weight, None, can_pack(weight.device, dtype))
    formats = {"dense": lambda x: F.linear(x, weight), "dense-packed": packed}
    if dtype == torch.bfloat16:
        codes = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (inner, hidden), dtype=torch.int32), 1)
        scale_zero = torch.randn(hidden // 32, inner, 2, dtype=dtype)
        int8 = torch.randint(-127, 127, (inner, hidden), dtype=torch.int8)
        scales = torch.rand(inner, dtype=dtype)
        formats = {"int4": lambda x: torch._weight_int4pack_mm_for_cpu(x, codes, 32, scale_zero),
                   "int8": lambda x: torch._weight_int8pack_mm(x, int8, scales), **formats}
    out: dict[str, dict[int, float]] = {name: {} for name in formats}
    for n in rows:
        x = torch.randn(n, hidden, dtype=dtype)
        for name, product in formats.items():
            out[name][n] = _p10_us(product, x, calls)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. target.dtype=float32")
    parser.add_argument("--drafter", default="release:math", help="folder or release:NAME")
    parser.add_argument("--benchmark", default="gsm8k")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rows", default="1,2,4,5,8,12,16", help="row counts of the product timings")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    target = TargetModel.load(cfg.target)
    drafter = load_drafter(target, args.drafter)
    prompts = benchmark_prompts(target, args.benchmark, args.limit)
    result = {"target": target.name, "dtype": target.dtype_note, "threads": torch.get_num_threads(),
              "drafter": args.drafter, "tree_sizes": tree_sizes(target, drafter, cfg.tree, prompts,
                                                                args.max_new_tokens),
              "product_us": products(target.hidden_size, target.config.intermediate_size, target.dtype,
                                     [int(r) for r in args.rows.split(",")], args.calls)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
