"""The target's forward per row count, six ways in one process: transformers' forward, the static engine
with plain ``F.linear`` products, with oneDNN-prepacked products (dense on CPU in float32, and in bfloat16
where oneDNN has native bf16), with int4 layer weights (where they run: bfloat16 on a CPU), with fp16
weights (where they run: float32 on a CPU with fbgemm) and with q4q8 weights (a CPU with a C compiler).

    python benchmarks/bench_engine.py [--dtype float32] [--rows 1,2,4,8,16,24,32] [--repeats 10]
    python benchmarks/bench_engine.py --products     # the layers' products alone, per weight format
    python benchmarks/bench_engine.py --attention --rows 1,4,8,16 --cached 150,400,800   # one attention call
    python benchmarks/bench_engine.py --dtype bfloat16 --int4-split --rows 1,4,8,12,16,24   # int4 codes or dense

Each row count n is one forward of n tokens (a chain of tree nodes, the LM head included) after the
prompt's cache, the mean of ``--repeats`` after one warm-up, the variants interleaved. Prints one
line per n, and the weight-read floor (every weight read once) measured in the same run.

``--products``: the 30 layers' four products of the embedded target's shapes on random weights (425 MB in
fp32, read from memory, not cache), per row count, as fp32 ``F.linear``, fp32 oneDNN-prepacked, bf16 and
fp16 ``F.linear``, torch's int8 weight-only kernel (``_weight_int8pack_mm``), bf16 oneDNN-prepacked,
int4 codes in groups of 32 (``models/quant.py``, bf16 and fp32 activations), fp16 weights through fbgemm
with fp32 activations (:class:`~taps_ray.models.quant.HalfLinear`) and the q4q8 kernel (bf16 and fp32
activations, :class:`~taps_ray.models.quant.Q4Q8Linear`): which formats pay here.

``--attention``: one ``scaled_dot_product_attention`` call of the embedded target's shape (9 query and 3 kv heads
of 64) for n new rows after each ``--cached`` length, keys and values in bf16 and in float32 (the query cast to
theirs, the output cast back to bf16, as the engine does), microseconds, the best of 3 rounds of 200 calls,
the two interleaved: why a bf16 target's KV cache is float32 on CPU (``engine.attention_dtype``)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from taps_ray.config import TargetConfig
from taps_ray.eval.bench import weight_read_floor
from taps_ray.models.engine import can_pack
from taps_ray.models.quant import (
    GROUP,
    INT4_MAX_ROWS,
    HalfLinear,
    Int4Linear,
    Q4Q8Linear,
    fp16_unsupported,
    int4_unsupported,
    q4q8_unsupported,
    quantize_rtn,
)
from taps_ray.models.target import TargetModel
from taps_ray.models.target_cache import crop_cache

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def set_packing(target: TargetModel, on: bool) -> None:
    """Switch the static engine's products between oneDNN-prepacked (``on``) and ``F.linear``."""
    for layer in target.engine.layers:
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            linear.pack = on
    target.engine.packed = on
    target.engine._head = None


def set_int4_rows(target: TargetModel, max_rows: int) -> None:
    """Make the int4 engine's layer products read their codes in steps of up to ``max_rows`` rows (wider steps
    run on the packed dense copy)."""
    for layer in target.engine.layers:
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            linear.max_rows = max_rows


def int4_split(ids: torch.Tensor, rows: list[int], repeats: int, dtype: str) -> None:
    """Per row count, one forward of the int4 target reading its codes, and the same target on its packed dense
    copy, interleaved: where :data:`~taps_ray.models.quant.INT4_MAX_ROWS` should sit."""
    target = TargetModel.load(TargetConfig(dtype=dtype, weights="int4"))
    print("rows | int4 codes ms | packed dense copy ms")
    for n in rows:
        times = {}
        for _ in range(3):
            for name, max_rows in (("codes", 1 << 30), ("dense", 0)):
                set_int4_rows(target, max_rows)
                times[name] = min(times.get(name, float("inf")), forward_ms(target, ids, n, repeats))
        print(f"{n} | {times['codes']:.1f} | {times['dense']:.1f}", flush=True)
    set_int4_rows(target, INT4_MAX_ROWS)


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


SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


@torch.inference_mode()
def products(rows: list[int], repeats: int) -> None:
    """Print ms of the layers' products per format and row count (min of ``repeats``)."""
    weights = [[torch.randn(o, i) for o, i in SHAPES] for _ in range(30)]
    formats = {"fp32": [[w for w in layer] for layer in weights]}
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer] for layer in weights]
    half = {name: [[w.to(dtype) for w in layer] for layer in weights]
            for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))}
    bf16_packed = ([[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer] for layer in half["bf16"]]
                   if can_pack(torch.device("cpu"), torch.bfloat16) else None)
    int4 = [[Int4Linear(quantize_rtn(w), None, torch.bfloat16, w) for w in layer] for layer in weights]
    q4q8 = (None if q4q8_unsupported(torch.device("cpu"), torch.float32) is not None
            else [[Q4Q8Linear(quantize_rtn(w), None, w) for w in layer] for layer in weights])
    fbgemm = (None if fp16_unsupported(torch.device("cpu"), torch.float32) is not None
              else [[HalfLinear(w, None) for w in layer] for layer in weights])
    int8 = []
    for layer in weights:
        row = []
        for w in layer:
            scale = w.abs().amax(1) / 127
            row.append(((w / scale[:, None]).round().to(torch.int8), scale))
        int8.append(row)

    def best(call) -> float:
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    print("rows | fp32 F.linear | fp32 oneDNN packed | bf16 F.linear | fp16 F.linear | int8 weight-only | "
          "bf16 oneDNN packed | int4 (bf16 activations) | int4 (fp32 activations) | fp16 fbgemm (fp32 activations) | "
          "q4q8 (bf16 activations) | q4q8 (fp32 activations)  (ms)")
    for n in rows:
        x = {576: torch.randn(n, 576), 1536: torch.randn(n, 1536)}
        cols = [best(lambda x=x: [F.linear(x[w.shape[1]], w) for layer in formats["fp32"] for w in layer]),
                best(lambda x=x: [torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                                  for layer, lp in zip(weights, packed) for w, p in zip(layer, lp)])]
        for name in ("bf16", "fp16"):
            xh = {k: v.to(half[name][0][0].dtype) for k, v in x.items()}
            cols.append(best(lambda xh=xh, name=name: [F.linear(xh[w.shape[1]], w) for layer in half[name]
                                                       for w in layer]))
        cols.append(best(lambda x=x: [torch.ops.aten._weight_int8pack_mm(x[q.shape[1]], q, s)
                                  for layer in int8 for q, s in layer]))
        xb = {k: v.to(torch.bfloat16) for k, v in x.items()}
        cols.append(float("nan") if bf16_packed is None else best(lambda xb=xb: [
            torch.ops.mkldnn._linear_pointwise(xb[w.shape[1]], p, None, "none", [], "")
            for layer, lp in zip(half["bf16"], bf16_packed) for w, p in zip(layer, lp)]))
        cols.append(best(lambda xb=xb: [q(xb[w.shape[1]]) for layer, lq in zip(weights, int4) for w, q in zip(layer, lq)]))
        cols.append(best(lambda x=x: [torch._weight_int4pack_mm_for_cpu(x[w.shape[1]], q.packed, GROUP, q.scale_zero.float())
                                      for layer, lq in zip(weights, int4) for w, q in zip(layer, lq)]))
        cols.append(float("nan") if fbgemm is None else best(
            lambda x=x: [h(x[w.shape[1]]) for layer, lh in zip(weights, fbgemm) for w, h in zip(layer, lh)]))
        for xs in (xb, x):
            cols.append(float("nan") if q4q8 is None else best(
                lambda xs=xs: [q(xs[w.shape[1]]) for layer, lq in zip(weights, q4q8) for w, q in zip(layer, lq)]))
        print(f"{n} | " + " | ".join(f"{c:.1f}" for c in cols))


def attention(rows: list[int], cached: list[int]) -> None:
    heads, kv_heads, dim = 9, 3, 64
    print("cached | rows | bf16 us | float32 us")
    for past in cached:
        for n in rows:
            best = {}
            for _ in range(3):
                for dtype in (torch.bfloat16, torch.float32):
                    q = torch.randn(1, heads, n, dim, dtype=torch.bfloat16)
                    k = torch.randn(1, kv_heads, past + n, dim, dtype=dtype)
                    v = torch.randn(1, kv_heads, past + n, dim, dtype=dtype)
                    mask = torch.zeros(n, past + n, dtype=dtype) if n > 1 else None
                    for _ in range(10):
                        F.scaled_dot_product_attention(q.to(dtype), k, v, attn_mask=mask, enable_gqa=True)
                    start = time.perf_counter()
                    for _ in range(200):
                        F.scaled_dot_product_attention(q.to(dtype), k, v, attn_mask=mask,
                                                       enable_gqa=True).to(torch.bfloat16)
                    spent = 1e6 * (time.perf_counter() - start) / 200
                    best[dtype] = min(best.get(dtype, spent), spent)
            print(f"{past} | {n} | {best[torch.bfloat16]:.0f} | {best[torch.float32]:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", default="1,2,4,8,16,24,32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--products", action="store_true", help="time the layers' products per weight format")
    parser.add_argument("--attention", action="store_true", help="time one attention call in bf16 and float32")
    parser.add_argument("--cached", default="150,400,800", help="--attention: cached lengths")
    parser.add_argument("--int4-split", action="store_true",
                        help="the int4 target per row count on its codes and on its packed dense copy (bf16)")
    args = parser.parse_args()
    if args.attention:
        attention([int(r) for r in args.rows.split(",")], [int(c) for c in args.cached.split(",")])
        return
    if args.products:
        products([int(r) for r in args.rows.split(",")], min(args.repeats, 5))
        return
    if args.int4_split:
        int4_split(TargetModel.load(TargetConfig(dtype=args.dtype)).encode_chat([{"role": "user", "content": PROMPT}]),
                   [int(r) for r in args.rows.split(",")], args.repeats, args.dtype)
        return
    static = TargetModel.load(TargetConfig(dtype=args.dtype, weights="dense"))
    hf = TargetModel.load(TargetConfig(dtype=args.dtype, engine="hf", weights="dense"))
    int4 = (TargetModel.load(TargetConfig(dtype=args.dtype, weights="int4"))
            if int4_unsupported(static.device, static.dtype) is None else None)
    fp16 = (TargetModel.load(TargetConfig(dtype=args.dtype, weights="fp16"))
            if fp16_unsupported(static.device, static.dtype) is None else None)
    q4q8 = (TargetModel.load(TargetConfig(dtype=args.dtype, weights="q4q8"))
            if q4q8_unsupported(static.device, static.dtype) is None else None)
    ids = static.encode_chat([{"role": "user", "content": PROMPT}])
    packable = can_pack(static.device, static.dtype)
    for name, target in (("dense", static), ("int4", int4), ("fp16", fp16), ("q4q8", q4q8)):
        if target is not None:
            floor = weight_read_floor(target)
            print(f"threads {torch.get_num_threads()}, dtype {args.dtype}, prompt {ids.shape[1]} tokens; {name} "
                  f"weight-read floor {floor['read_ms']} ms ({floor['weight_mb']} MB at {floor['gb_per_s']} GB/s)")
    print("rows | transformers ms | static, F.linear ms | static, oneDNN packed ms | static, int4 ms | static, fp16 ms | "
          "static, q4q8 ms")
    for rows in (int(r) for r in args.rows.split(",")):
        hf_ms = forward_ms(hf, ids, rows, args.repeats)
        set_packing(static, False)
        plain_ms = forward_ms(static, ids, rows, args.repeats)
        set_packing(static, packable)
        packed_ms = forward_ms(static, ids, rows, args.repeats)
        int4_ms = forward_ms(int4, ids, rows, args.repeats) if int4 is not None else float("nan")
        fp16_ms = forward_ms(fp16, ids, rows, args.repeats) if fp16 is not None else float("nan")
        q4q8_ms = forward_ms(q4q8, ids, rows, args.repeats) if q4q8 is not None else float("nan")
        print(f"{rows} | {hf_ms:.1f} | {plain_ms:.1f} | {packed_ms:.1f} | {int4_ms:.1f} | {fp16_ms:.1f} | {q4q8_ms:.1f}")


if __name__ == "__main__":
    main()
