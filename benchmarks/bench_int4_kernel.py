"""A hand-written int4 product (``int4_kernel_trial.c``) against torch's ``_weight_int4pack_mm_for_cpu``.

    python benchmarks/bench_int4_kernel.py [--n 1536] [--k 576] [--rows 1,2,4,8,16,32,64] [--calls 200]

Builds the C file with ``cc -O3 -march=native -fopenmp`` into a temporary folder, loads it through ctypes (OpenMP
on torch's own libgomp), checks its float32 products against the dequantized weights and that a row's result
does not depend on the row count, then prints microseconds per call (mean of ``--calls``) per row count: torch's
kernel (bf16 activations) and the trial kernel in bf16 and float32. docs/BENCHMARKS.md (twenty-second session)
has the result: the trial is slower, so taps_ray does not use it.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from taps_ray.models.quant import GROUP, quantize_rtn

SOURCE = Path(__file__).with_name("int4_kernel_trial.c")


def load(folder: Path):
    library = folder / "int4_kernel_trial.so"
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(library), str(SOURCE)],
                   check=True)
    lib = ctypes.CDLL(str(library))
    pointer, size, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.taps_int4_matmul.argtypes = [pointer, flag, size, size, pointer, pointer, pointer, pointer, size, pointer, flag]
    return lib


def trial_product(lib, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                  minimum: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], codes.shape[0], dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.taps_int4_matmul(x.data_ptr(), bf16, x.shape[0], x.shape[1], codes.data_ptr(), scale.data_ptr(),
                         minimum.data_ptr(), None, codes.shape[0], out.data_ptr(), bf16)
    return out


def timed(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    weight = quantize_rtn(torch.randn(args.n, args.k) * 0.05)
    grouped = weight.codes.to(torch.uint8).reshape(args.n, args.k // GROUP, 2, 16)
    codes = (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(args.n, args.k // 2).contiguous()
    scale, minimum = weight.scale.float().contiguous(), weight.minimum.float().contiguous()
    packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32).contiguous(), 1)
    scale_zero = torch.stack([weight.scale.T, (weight.minimum + 8 * weight.scale).T], dim=-1).bfloat16().contiguous()
    with tempfile.TemporaryDirectory() as folder:
        lib = load(Path(folder))
        x = torch.randn(9, args.k)
        exact = x.double() @ weight.dequantize().double().T
        got = trial_product(lib, x, codes, scale, minimum)
        alone = torch.cat([trial_product(lib, x[i:i + 1], codes, scale, minimum) for i in range(9)])
        error = float((got - exact).abs().max() / exact.abs().max())
        print(f"trial vs dequantized: largest relative error {error:.2e}; "
              f"rows independent of the row count: {torch.equal(got, alone)}")
        print(f"{args.n}x{args.k}, {torch.get_num_threads()} threads, us per call")
        print(f"{'rows':>5} {'torch int4 bf16':>16} {'trial bf16':>11} {'trial fp32':>11}")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.k)
            xb = x.bfloat16()
            torch_us = timed(lambda xb=xb: torch._weight_int4pack_mm_for_cpu(xb, packed, GROUP, scale_zero), args.calls)
            bf16_us = timed(lambda xb=xb: trial_product(lib, xb, codes, scale, minimum), args.calls)
            fp32_us = timed(lambda x=x: trial_product(lib, x, codes, scale, minimum), args.calls)
            print(f"{rows:>5} {torch_us:>16.1f} {bf16_us:>11.1f} {fp32_us:>11.1f}")


if __name__ == "__main__":
    main()
