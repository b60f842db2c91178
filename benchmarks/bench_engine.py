"""The target's forward per row count, three ways in one process: transformers' forward, the static engine
with plain ``F.linear`` products, and the static engine with oneDNN-prepacked products (the default on CPU
in float32).

    python benchmarks/bench_engine.py [--dtype float32] [--rows 1,2,4,8,16,24,32] [--repeats 10]

Each row count n is one forward of n tokens (a chain of tree nodes, the LM head included) after the
prompt's cache, the mean of ``--repeats`` after one warm-up, the three variants interleaved. Prints one
line per n, and the weight-read floor (every weight read once) measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from taps_ray.config import TargetConfig
from taps_ray.eval.bench import weight_read_floor
from taps_ray.models.engine import can_pack
from taps_ray.models.target import TargetModel, crop_cache

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def set_packing(target: TargetModel, on: bool) -> None:
    """Switch the static engine's products between oneDNN-prepacked (``on``) and ``F.linear``."""
    for layer in target.engine.layers:
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            linear.pack = on
    target.engine.packed = on
    target.engine._head = None


@torch.inference_mode()
def forward_ms(target: TargetModel, ids: torch.Tensor, rows: int, repeats: int) -> float:
    cache = target.new_cache(ids.shape[1] + rows)
    target.prefill(ids, cache)
    past = ids.shape[1]
    tokens = torch.full((1, rows), 100, dtype=torch.long)
    positions = torch.arange(past, past + rows)[None]
    causal = torch.zeros(rows, past + rows).masked_fill(
        torch.ones(rows, past + rows, dtype=torch.bool).triu(past + 1), torch.finfo(torch.float32).min)
    mask = None if rows == 1 else causal[None, None].to(target.dtype)
    target.logits(target.forward_hidden(tokens, positions, cache, mask))
    crop_cache(cache, past)
    start = time.perf_counter()
    for _ in range(repeats):
        target.logits(target.forward_hidden(tokens, positions, cache, mask))
        crop_cache(cache, past)
    return 1e3 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", default="1,2,4,8,16,24,32")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    static = TargetModel.load(TargetConfig(dtype=args.dtype))
    hf = TargetModel.load(TargetConfig(dtype=args.dtype, engine="hf"))
    ids = static.encode_chat([{"role": "user", "content": PROMPT}])
    packable = can_pack(static.device, static.dtype)
    floor = weight_read_floor(static)
    print(f"threads {torch.get_num_threads()}, dtype {args.dtype}, prompt {ids.shape[1]} tokens; weight-read floor "
          f"{floor['read_ms']} ms ({floor['weight_mb']} MB at {floor['gb_per_s']} GB/s)")
    print("rows | transformers ms | static, F.linear ms | static, oneDNN packed ms")
    for rows in (int(r) for r in args.rows.split(",")):
        hf_ms = forward_ms(hf, ids, rows, args.repeats)
        set_packing(static, False)
        plain_ms = forward_ms(static, ids, rows, args.repeats)
        set_packing(static, packable)
        packed_ms = forward_ms(static, ids, rows, args.repeats)
        print(f"{rows} | {hf_ms:.1f} | {plain_ms:.1f} | {packed_ms:.1f}")


if __name__ == "__main__":
    main()
