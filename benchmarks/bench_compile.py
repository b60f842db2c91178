"""Does ``torch.compile`` (inductor) pay on the static engine's layers here? The 30 layers' work outside
attention (norms, the q/k/v product and rotary embedding; the output product, the MLP and the residuals),
eager against compiled per row count, on the target's own weights in the format it runs (``--weights``).

    python benchmarks/bench_compile.py [--weights int4|dense] [--rows 1,4] [--repeats 20]

Prints the compile seconds (kept out of the timings), then per row count the eager and compiled ms of one
pass over the layers, interleaved; attention and the KV cache are left out (their bookkeeping breaks graphs).
The norms here are ``F.rms_norm`` (one op, the same values as the models' modules).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from taps_ray.config import TargetConfig
from taps_ray.models.engine import _rope
from taps_ray.models.quant import GROUP, Int4Linear
from taps_ray.models.target import TargetModel


def layer_parts(target: TargetModel):
    """(pre, post, per-layer inputs): one layer's work as functions of tensors only (no Python objects to
    guard on), for the format the engine runs: int4 codes through torch's int4 kernel, or dense weights."""
    engine = target.engine
    h, g, d = engine.heads, engine.kv_heads, engine.head_dim
    eps = engine.layers[0].norm_in.variance_epsilon

    def product(x, weight, scale_zero):
        if scale_zero is None:
            return F.linear(x, weight)
        return torch._weight_int4pack_mm_for_cpu(x, weight, GROUP, scale_zero)

    def norm(x, weight):
        return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)

    def pre(x, norm_in, qkv, qkv_sz, cos, sin):
        q, k, v = product(norm(x, norm_in), qkv, qkv_sz).split((h * d, g * d, g * d), dim=-1)
        return _rope(q.view(-1, h, d), cos, sin), _rope(k.view(-1, g, d), cos, sin), v

    def post(x, attended, o, o_sz, norm_post, gate_up, gate_up_sz, down, down_sz):
        x = x + product(attended, o, o_sz)
        gate, up = product(norm(x, norm_post), gate_up, gate_up_sz).chunk(2, dim=-1)
        return x + product(F.silu(gate) * up, down, down_sz)

    def tensors(linear):
        return (linear.packed, linear.scale_zero) if isinstance(linear, Int4Linear) else (linear.weight, None)

    inputs = [((layer.norm_in.weight, *tensors(layer.qkv)),
               (*tensors(layer.o_proj), layer.norm_post.weight, *tensors(layer.gate_up), *tensors(layer.down)))
              for layer in engine.layers]
    return pre, post, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="auto", choices=["auto", "int4", "dense"])
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    target = TargetModel.load(TargetConfig(weights=args.weights))
    pre, post, inputs = layer_parts(target)
    compiled = (torch.compile(pre, dynamic=False), torch.compile(post, dynamic=False))
    hidden, dtype = target.hidden_size, target.dtype
    print(f"target {target.name}, {str(dtype).removeprefix('torch.')}, weights {target.weights}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")

    def one_pass(parts, rows: int) -> None:
        x = torch.randn(rows, hidden, dtype=dtype) * 0.1
        cos = torch.ones(rows, 1, target.engine.head_dim, dtype=dtype)
        sin = torch.zeros_like(cos)
        attended = torch.randn(rows, hidden, dtype=dtype) * 0.1
        for pre_in, post_in in inputs:
            parts[0](x, *pre_in, cos, sin)
            x = parts[1](x, attended, *post_in)

    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            start = time.perf_counter()
            one_pass(compiled, rows)
            compile_s = time.perf_counter() - start
            times = {"eager": [], "compiled": []}
            for _ in range(args.repeats):
                for name, parts in (("eager", (pre, post)), ("compiled", compiled)):
                    start = time.perf_counter()
                    one_pass(parts, rows)
                    times[name].append(1e3 * (time.perf_counter() - start))
            eager, fast = (statistics.median(times[k]) for k in ("eager", "compiled"))
            print(f"rows {rows}: compile {compile_s:.1f} s; eager {eager:.2f} ms, compiled {fast:.2f} ms "
                  f"({eager / fast:.2f}x)")


if __name__ == "__main__":
    main()
