"""Does ``torch.compile`` (inductor) pay on the static engine's layers here? The 30 layers' work outside
attention (norms, the q/k/v product and rotary embedding; the output product, the MLP and the residuals),
eager against compiled per row count, on the target's own weights in the format it runs (``--weights``).

    python benchmarks/bench_compile.py [--weights auto|int4|dense|fp16] [--rows 1,16] [--repeats 20] [--stack]

Prints the compile seconds (kept out of the timings), then per row count the eager and compiled ms of one
pass over the layers, interleaved. Without ``--stack`` each layer's two parts are compiled functions called
per layer (60 calls a pass, as an engine that keeps attention eager between them would); with ``--stack``
the whole pass is one compiled call (the bound a fully compiled forward could reach, attention aside).
Attention and the KV cache are left out. fp16 products run through a custom op around fbgemm's
(``quantized.linear_dynamic_fp16``, whose packed weight dynamo cannot trace), its weight named by a
0-dim tensor handle so that one graph serves every layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from taps_ray.config import TargetConfig
from taps_ray.models.engine import _rope
from taps_ray.models.quant import GROUP, HalfLinear, Int4Linear
from taps_ray.models.target import TargetModel

PACKED: list = []


@torch.library.custom_op("taps_bench::half_mm", mutates_args=())
def half_mm(x: torch.Tensor, handle: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` [T, K] times the fp16 weight registered as ``PACKED[handle]`` [n, K]: [T, n]."""
    return torch.ops.quantized.linear_dynamic_fp16(x, PACKED[int(handle)])


@half_mm.register_fake
def _(x, handle, n):
    return x.new_empty(x.shape[0], n)


def layer_parts(target: TargetModel):
    """(pre, post, per-layer inputs): one layer's work as functions of tensors only (no Python objects to
    guard on), for the format the engine runs."""
    engine = target.engine
    h, g, d = engine.heads, engine.kv_heads, engine.head_dim
    eps = engine.layers[0].norm_in.eps

    def product(x, weight, extra):
        if isinstance(extra, int):
            return half_mm(x, weight, extra)
        if extra is None:
            return F.linear(x, weight)
        return torch._weight_int4pack_mm_for_cpu(x, weight, GROUP, extra)

    def pre(x, norm_in, qkv, qkv_extra, cos, sin):
        qkv = product(F.rms_norm(x, x.shape[-1:], norm_in, eps), qkv, qkv_extra)
        qk, v = qkv.split(((h + g) * d, g * d), dim=-1)
        return _rope(qk.view(-1, h + g, d), cos, sin), v

    def post(x, attended, o, o_extra, norm_post, gate_up, gate_up_extra, down, down_extra):
        x = x + product(attended, o, o_extra)
        gate, up = product(F.rms_norm(x, x.shape[-1:], norm_post, eps), gate_up, gate_up_extra).chunk(2, dim=-1)
        return x + product(F.silu(gate) * up, down, down_extra)

    def tensors(linear):
        if isinstance(linear, Int4Linear):
            return linear.packed, linear.scale_zero
        if isinstance(linear, HalfLinear):
            PACKED.append(linear.packed)
            return torch.tensor(len(PACKED) - 1), linear.weight.shape[0]
        return linear.weight, None

    inputs = [((layer.norm_in.module.weight, *tensors(layer.qkv)),
               (*tensors(layer.o_proj), layer.norm_post.module.weight, *tensors(layer.gate_up), *tensors(layer.down)))
              for layer in engine.layers]
    return pre, post, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="auto", choices=["auto", "int4", "dense", "fp16"])
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--stack", action="store_true", help="compile the whole pass over the layers as one call")
    args = parser.parse_args()
    target = TargetModel.load(TargetConfig(weights=args.weights))
    pre, post, inputs = layer_parts(target)
    hidden, dtype, head_dim = target.hidden_size, target.dtype, target.engine.head_dim
    print(f"target {target.name}, {target.precision}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{'one compiled call a pass' if args.stack else 'two compiled calls a layer'}")

    def one_pass(x, attended, cos, sin, parts=(pre, post)):
        for pre_in, post_in in inputs:
            parts[0](x, *pre_in, cos, sin)
            x = parts[1](x, attended, *post_in)
        return x

    if args.stack:
        compiled = torch.compile(one_pass, dynamic=False)
    else:
        pieces = (torch.compile(pre, dynamic=False), torch.compile(post, dynamic=False))
        compiled = lambda *a: one_pass(*a, parts=pieces)  # noqa: E731

    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, hidden, dtype=dtype) * 0.1
            attended = torch.randn(rows, hidden, dtype=dtype) * 0.1
            cos = torch.ones(rows, 1, head_dim, dtype=dtype)
            sin = torch.zeros_like(cos)
            start = time.perf_counter()
            compiled(x, attended, cos, sin)
            compile_s = time.perf_counter() - start
            times = {"eager": [], "compiled": []}
            for _ in range(args.repeats):
                for name, run in (("eager", one_pass), ("compiled", compiled)):
                    start = time.perf_counter()
                    run(x, attended, cos, sin)
                    times[name].append(1e3 * (time.perf_counter() - start))
            eager, fast = (statistics.median(times[k]) for k in ("eager", "compiled"))
            print(f"rows {rows}: compile {compile_s:.1f} s; eager {eager:.2f} ms, compiled {fast:.2f} ms "
                  f"({eager / fast:.2f}x)")


if __name__ == "__main__":
    main()
