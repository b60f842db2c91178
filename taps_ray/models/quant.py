"""Reduced-precision weight formats of the static engine's products (``target.weights``).

**int4.** A weight ``W`` [N, K] is stored as codes ``q`` in 0..15 in groups of :data:`GROUP` along K, each group with
a scale ``d`` and a minimum ``m``: ``W = d * q + m``, the layout of GGUF's Q4_1 blocks. For a GGUF target
(the embedded one included) the codes, scales and minima are the file's own, read by :func:`read_gguf_q4_1`;
for any other target they come from the dense weights by round-to-nearest (:func:`quantize_rtn`). The
product runs through torch's CPU kernel ``_weight_int4pack_mm_for_cpu``, which dequantizes
``(q - 8) * scale + zero`` per group inside the matmul, so ``zero = m + 8 d``.

**fp16.** Half-precision weights with float32 activations and float32 accumulation, through fbgemm's fp16
GEMM behind torch's ``quantized.linear_dynamic_fp16`` (:class:`HalfLinear`): half the bytes of float32 per
step on any x86 CPU, AVX2 included, where torch's bf16 and int8 kernels are slower than float32 and its int4
kernel (bf16 activations) is slower than this one from 8 rows on (docs/BENCHMARKS.md). fbgemm cuts the rows
of a product into blocks and runs a block of one or two rows through kernels whose sums round otherwise, so
for some row counts (1, 2, 7, 14, 31, 32, ... on AVX2) a row's result depends on how many rows share its
step. Which counts do is probed once per process and thread count (:func:`half_row_counts`), and a product
of such a count runs on the next count that does not, padded with zero rows: a plain step then rounds
exactly as the same row inside a tree step, and greedy speculation equals vanilla bitwise on these weights.

Shapes: ``N`` output features, ``K`` input features, ``G = K / GROUP`` groups per row, ``T`` rows of a step.
"""

from __future__ import annotations

import abc
import mmap
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from taps_ray.models.native import KernelBuildError, compiler, pack_q4q8, pack_q8q8, q4q8_library, q4q8_matmul

GROUP = 32
WEIGHT_FORMATS = ("auto", "dense", "int4", "fp16", "q4q8")
HALF_PROBE_ROWS = 256
LAYER_PROJECTIONS = {  # GGUF block tensor -> the HF module path inside a decoder layer
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of 32 nibbles
INT8_LEVELS = 127.0


@dataclass
class Int4Weight:
    """``codes`` [N, K] uint8 in 0..15, ``scale`` and ``minimum`` [N, G] float32: ``W = scale * codes + minimum``
    per group of :data:`GROUP` columns."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these codes stand for."""
        expand = lambda t: t.repeat_interleave(GROUP, dim=1)  # noqa: E731
        return self.codes.float() * expand(self.scale) + expand(self.minimum)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """The weights of ``parts`` stacked along N (as the engine fuses q/k/v and gate/up)."""
        return Int4Weight(*(torch.cat([getattr(p, name) for p in parts]) for name in ("codes", "scale", "minimum")))


def quantize_rtn(weight: torch.Tensor) -> Int4Weight:
    """Round-to-nearest asymmetric 4-bit codes of ``weight`` [N, K] (K a multiple of :data:`GROUP`), each
    group's minimum and ``(max - min) / 15`` as its scale, as llama.cpp's Q4_1 quantizer does."""
    n, k = weight.shape
    groups = weight.detach().float().cpu().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - low[..., None]) / safe[..., None]).round().clamp_(0, 15).to(torch.uint8)
    return Int4Weight(codes.reshape(n, k), scale, low)


def _q4_1_blocks(data: np.ndarray, rows: int, cols: int) -> Int4Weight:
    """Codes, scales and minima of a Q4_1 tensor whose raw bytes are ``data`` [rows, cols / 32 * 20]."""
    blocks = np.ascontiguousarray(data).reshape(rows, cols // GROUP, Q4_1_BLOCK_BYTES)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(minimum))


def _unpermute_rope_rows(weight: Int4Weight, heads: int) -> Int4Weight:
    """Undo llama.cpp's row order of a Llama q/k projection (rotary halves interleaved per head), as
    transformers' GGUF loader does for the dense weight; rows move whole, so groups stay intact."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    return Int4Weight(rows(weight.codes), rows(weight.scale), rows(weight.minimum))


def read_gguf_q4_1(path: str | Path, config) -> dict[str, Int4Weight]:
    """Every Q4_1 decoder-layer projection of the GGUF file at ``path``, keyed by its HF parameter name
    (``model.layers.{i}.self_attn.q_proj.weight`` ...); tensors in other GGUF types are left out (the caller
    quantizes those from the dense weights). ``config``: the target's HF text config (Llama q/k rows are
    reordered as transformers' loader reorders the dense ones)."""
    arch, tensors = gguf_tensor_index(path)
    data = np.memmap(path, mode="r")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    out: dict[str, Int4Weight] = {}
    for name, (kind, dims, offset) in tensors.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_PROJECTIONS or kind != GGML_Q4_1:
            continue
        cols, rows = dims
        size = rows * cols // GROUP * Q4_1_BLOCK_BYTES
        weight = _q4_1_blocks(data[offset:offset + size], rows, cols)
        if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
            weight = _unpermute_rope_rows(weight, heads if parts[2] == "attn_q" else kv_heads)
        out[f"model.layers.{parts[1]}.{LAYER_PROJECTIONS[parts[2]]}.weight"] = weight
    return out


GGML_Q4_1 = 3
GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value type -> bytes (8: string and 9: array are read apart)."""


def gguf_tensor_index(path: str | Path) -> tuple[str, dict[str, tuple[int, tuple[int, ...], int]]]:
    """The architecture of the GGUF file at ``path`` and, per tensor, ``(ggml type, dims, byte offset in the
    file)``. Reads the header only, skipping the metadata values it does not need: ``gguf.GGUFReader`` parses
    every one (the tokenizer's ~100k strings), 3 s of a 135M target's load."""
    with open(path, "rb") as f:
        head = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, head, pos)
        pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string() -> str:
        nonlocal pos
        length = take("Q")
        pos += length
        return head[pos - length:pos].decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            string()
        elif kind == 9:
            inner, count = take("IQ")
            if inner in GGUF_SCALARS:
                pos += GGUF_SCALARS[inner] * count
            else:
                for _ in range(count):
                    skip(inner)
        else:
            pos += GGUF_SCALARS[kind]

    magic, version, n_tensors, n_kv = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path} is not a GGUF file of version 2 or later (magic {magic!r}, version {version})")
    arch, alignment = "", 32
    for _ in range(n_kv):
        key, kind = string(), take("I")
        if key == "general.architecture" and kind == 8:
            arch = string()
        elif key == "general.alignment" and kind == 4:
            alignment = take("I")
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("I")
        dims = tuple(take("Q") for _ in range(n_dims))
        kind, offset = take("IQ")
        infos.append((name, kind, dims, offset))
    start = -(-pos // alignment) * alignment
    return arch, {name: (kind, dims, start + offset) for name, kind, dims, offset in infos}


def int4_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int4 weights cannot run on ``device`` in ``dtype``, or None when they can (a CPU, bfloat16
    activations: torch's float32 path of the kernel is slower than dense, docs/BENCHMARKS.md)."""
    if device.type != "cpu":
        return f"int4 weights run on the CPU kernel only (device {device.type}); use target.weights=dense"
    if dtype != torch.bfloat16:
        return (f"int4 weights need bfloat16 activations (target.dtype={str(dtype).removeprefix('torch.')}: "
                f"torch's kernel is slower than dense there); use target.dtype=bfloat16 or target.weights=dense")
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return f"this torch ({torch.__version__}) has no _weight_int4pack_mm_for_cpu"
    return None


def fp16_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why fp16 weights cannot run on ``device`` in ``dtype``, or None when they can (a CPU whose torch has
    fbgemm, float32 activations)."""
    if device.type != "cpu":
        return f"fp16 weights run on fbgemm's CPU kernel only (device {device.type}); use target.weights=dense"
    if dtype != torch.float32:
        return (f"fp16 weights take float32 activations (target.dtype={str(dtype).removeprefix('torch.')}); "
                f"use target.dtype=float32 or target.weights=dense")
    if "fbgemm" not in torch.backends.quantized.supported_engines or torch.backends.quantized.engine not in (
            "fbgemm", "x86"):
        return (f"this torch ({torch.__version__}, quantized engine {torch.backends.quantized.engine}) has no fbgemm "
                f"fp16 GEMM on this CPU; use target.weights=dense")
    return None


def q4q8_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why q4q8 products cannot run on ``device`` in ``dtype``, or None when they can (a CPU, float32 or bfloat16
    activations, a C compiler that builds the kernel: :mod:`~taps_ray.models.native`; the build, once per machine
    kind, happens here)."""
    if device.type != "cpu":
        return f"q4q8 weights run on a CPU kernel only (device {device.type}); use target.weights=dense"
    if dtype not in (torch.float32, torch.bfloat16):
        return (f"q4q8 weights take float32 or bfloat16 activations (target.dtype="
                f"{str(dtype).removeprefix('torch.')}); use target.weights=dense")
    if compiler() is None:
        return "q4q8 weights build their kernel with a C compiler (cc or $CC), and there is none here"
    try:
        q4q8_library()
    except KernelBuildError as err:
        return f"the q4q8 kernel does not build here: {str(err).splitlines()[0]}"
    return None


def weights_unsupported(weights: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the format ``weights`` (dense, int4, fp16 or q4q8) cannot run on ``device`` in ``dtype``, or None."""
    if weights == "int4":
        return int4_unsupported(device, dtype)
    if weights == "fp16":
        return fp16_unsupported(device, dtype)
    if weights == "q4q8":
        return q4q8_unsupported(device, dtype)
    return None


def auto_weights(device: torch.device, dtype: torch.dtype, dtype_requested: str = "auto") -> str:
    """``target.weights: auto``, where each format was measured faster than dense (docs/BENCHMARKS.md): on a CPU with
    native bf16 running bfloat16, q4q8 where its kernel builds (a C compiler), else int4; fp16 on a CPU running
    float32 because ``target.dtype`` was ``auto`` (an explicit ``float32`` keeps dense float32 weights, the bitwise
    reference); dense everywhere else."""
    from taps_ray.models.target_loading import cpu_native_bf16

    if int4_unsupported(device, dtype) is None and cpu_native_bf16():
        return "q4q8" if q4q8_unsupported(device, dtype) is None else "int4"
    if dtype_requested == "auto" and fp16_unsupported(device, dtype) is None:
        return "fp16"
    return "dense"


INT4_MAX_ROWS = 15
"""Rows up to which an int4 product with a ``wide`` alternative reads its codes: torch's int4 CPU kernel costs
grow with every few rows, and from about this many rows a whole forward of the embedded target on oneDNN's
packed bf16 weights is faster (``benchmarks/bench_engine.py --dtype bfloat16``, docs/BENCHMARKS.md)."""


class Int4Linear:
    """``x [T, K] -> x @ W.T + bias`` [T, N] for an :class:`Int4Weight`, in ``dtype`` (bfloat16), through torch's
    ``_weight_int4pack_mm_for_cpu``; where ``wide`` is given (the same product on the dense weights, e.g. oneDNN's
    packed bf16), a step of more than ``max_rows`` rows takes that instead (a tree verification, a prefill, a
    batch of requests). ``source``: the dense parameter the codes were made from; a change to it after packing
    (its storage or ``_version``) is an error, never a silently stale product."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype, source: torch.Tensor,
                 wide=None, max_rows: int = INT4_MAX_ROWS):
        n, k = weight.codes.shape
        if k % GROUP:
            raise ValueError(f"int4 weights need input features in multiples of {GROUP}, got {k}")
        self.packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32).contiguous(), 1)
        self.scale_zero = torch.stack([weight.scale.T, (weight.minimum + 8 * weight.scale).T], dim=-1).to(dtype).contiguous()
        self.bias = bias
        self.source, self._key = source, tensor_identity(source)
        self.wide, self.max_rows = wide, max_rows

    def check(self) -> None:
        """RuntimeError if the dense parameter changed after its codes were packed."""
        check_unchanged(self.source, self._key, "int4")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.check()
        if self.wide is not None and x.shape[0] > self.max_rows:
            return self.wide(x)
        out = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, GROUP, self.scale_zero)
        return out if self.bias is None else out + self.bias


class _Int8ActivationProduct:
    """``x [T, K] -> x @ W.T + bias`` [T, N] in ``x``'s dtype (float32 or bfloat16) on a weight packed for the C
    kernel of :mod:`~taps_ray.models.native` (``codes``: ``q4`` or ``q8``), each row of ``x`` quantized to int8 per
    group of 32 on the fly; a row's result does not depend on the other rows of its step. ``weight``: the dense
    parameter the codes were made from (``key``: its identity then); a change to it after packing is an error."""

    codes = "q4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor, out_features: int,
                 in_features: int):
        self.packed, self.out_features, self.in_features = packed, out_features, in_features
        self.weight, self.bias = weight, None if bias is None else bias.detach().float().contiguous()
        self.key = tensor_identity(weight)

    @staticmethod
    def check_shape(n: int, k: int, name: str) -> None:
        """ValueError unless the kernel can tile an [n, k] weight."""
        if k % GROUP or n % 16:
            raise ValueError(f"{name} weights need input features in multiples of {GROUP} and output features in "
                             f"multiples of 16, got {n}x{k}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_unchanged(self.weight, self.key, "q4q8" if self.codes == "q4" else "q8q8")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"a {self.codes}-coded product takes CPU inputs [T, {self.in_features}], got {list(x.shape)}")
        return q4q8_matmul(x.contiguous(), self.packed, self.out_features, self.bias, codes=self.codes)


class Q4Q8Linear(_Int8ActivationProduct):
    """The product of an :class:`Int4Weight` (GGUF's Q4_1 x Q8_1 arithmetic): a q4q8 engine's layer products.
    ``source``: the dense parameter the codes were made from."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, source: torch.Tensor):
        n, k = weight.codes.shape
        self.check_shape(n, k, "q4q8")
        super().__init__(source, bias, pack_q4q8(weight.codes, weight.scale, weight.minimum), n, k)


class Q8Q8Linear(_Int8ActivationProduct):
    """The product of int8 codes of ``weight`` [N, K] (round-to-nearest per group of 32, one fp16 scale each:
    GGUF's Q8_0, the format the embedded GGUF stores its tied head in): the LM head of a q4q8 engine, half the bytes
    of a bf16 head."""

    codes = "q8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        n, k = weight.shape
        self.check_shape(n, k, "q8q8")
        groups = weight.detach().float().cpu().reshape(n, k // GROUP, GROUP)
        scale = (groups.abs().amax(-1) / INT8_LEVELS).half()  # [N, G]
        step = scale.float().unsqueeze(-1)
        codes = torch.where(step > 0, groups / torch.where(step > 0, step, 1.0), 0.0).round().clamp(-127, 127)
        super().__init__(weight, bias, pack_q8q8(codes.to(torch.int8).reshape(n, k), scale), n, k)


class HalfLinear:
    """``x [T, K] -> x @ fp16(W).T + bias`` [T, N] in float32, through fbgemm's fp16-weight GEMM on a packed
    half-precision copy of ``weight`` [N, K] (accumulation in float32, torch's threads). Rows are padded to
    the next row count :func:`half_row_counts` finds consistent, so each row's result is the same whatever the
    row count. ``weight`` is the dense parameter the copy was made from: a change to it after packing is an
    error, never a stale product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float().contiguous(), None if bias is None else bias.detach().float())
        self.weight, self.bias = weight, bias
        self.in_features = weight.shape[1]
        self._key = tensor_identity(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_unchanged(self.weight, self._key, "fp16")
        rows = x.shape[0]
        padded = half_rows(rows)
        if padded > rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)[:rows]

    def read_proxy(self) -> torch.Tensor:
        """A half-precision tensor of the packed copy's size: what the weight-read floor reads in its place (the
        packed copy itself is opaque to torch)."""
        return self.weight.detach().half()


class LinearForward(abc.ABC):
    """A drafter ``nn.Linear``'s forward (installed by :func:`install_forwards`): without autograd, where
    :meth:`applies`, the product :meth:`make` builds from the weight and bias, made again whenever either is replaced
    or changed in place; otherwise (training, another device or dtype) ``F.linear`` as before. Threads calling it
    at once make the product once. Pickles and copies without the product (made again on first use)."""

    def __init__(self, module: torch.nn.Linear):
        self.module, self._product, self._lock = module, None, threading.Lock()
        self._key: tuple | None = None

    @abc.abstractmethod
    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this input and weight take the product (else ``F.linear``)."""

    @abc.abstractmethod
    def make(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """The product ``x [T, in] -> [T, out]`` of ``weight`` and ``bias``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if (torch.is_grad_enabled() and weight.requires_grad) or not self.applies(x, weight):
            return F.linear(x, weight, bias)
        key = (tensor_identity(weight), None if bias is None else tensor_identity(bias))
        if key != self._key:
            with self._lock:
                if key != self._key:
                    self._product, self._key = self.make(weight, bias), key
        return self._product(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def __getstate__(self) -> dict:
        return {"module": self.module}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["module"])


def install_forwards(module: torch.nn.Module, kind: type[LinearForward]) -> None:
    """Give every ``nn.Linear`` of ``module`` a ``kind`` forward; idempotent."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear) and not isinstance(sub.__dict__.get("forward"), kind):
            sub.forward = kind(sub)


class HalfLinearForward(LinearForward):
    """On a CPU float32 input and weight, the product of a :class:`HalfLinear` (half-precision weights)."""

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and weight.device.type == "cpu" and weight.dtype == torch.float32

    def make(self, weight: torch.Tensor, bias: torch.Tensor | None) -> HalfLinear:
        return HalfLinear(weight, bias)


def read_linears_in_half(module: torch.nn.Module) -> None:
    """Make every ``nn.Linear`` of ``module`` (a drafter) compute, outside autograd, on half-precision weights
    (:class:`HalfLinearForward`); idempotent. For a target that reads its own weights in fp16: the drafter's
    products are then as cheap as the target's (MKL's float32 GEMM is 2-4x slower at the 1-3 rows a drafter
    runs on the CPUs measured, docs/BENCHMARKS.md)."""
    install_forwards(module, HalfLinearForward)


class Q8LinearForward(LinearForward):
    """On a CPU float32 or bfloat16 input of the weight's dtype, whose shape the kernel tiles, the product of a
    :class:`Q8Q8Linear` (int8 codes of the weight per group of 32 times int8 activations)."""

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return (x.dtype == weight.dtype and x.device.type == weight.device.type == "cpu" and x.shape[-1] == k
                and weight.dtype in (torch.float32, torch.bfloat16) and k % GROUP == 0 and n % 16 == 0)

    def make(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Q8Q8Linear:
        return Q8Q8Linear(weight.detach(), bias)


def read_linears_in_q8(module: torch.nn.Module) -> None:
    """Make every ``nn.Linear`` of ``module`` (a drafter) compute, outside autograd, on Q8_0 codes of its weight
    times int8 activations (:class:`Q8LinearForward`); idempotent. For a q4q8 target (an fp16 one where the kernel
    builds): 0.23-0.47 ms for a drafter's eight products at 1-9 rows against 0.50-0.90 ms packed bf16
    (docs/BENCHMARKS.md, thirty-fifth session). The codes change what is drafted, never what is accepted."""
    install_forwards(module, Q8LinearForward)


_row_counts: dict[int, list[int]] = {}


def half_rows(rows: int) -> int:
    """The row count a fp16 product of ``rows`` rows runs on (:func:`half_row_counts`; unpadded beyond the probe)."""
    counts = half_row_counts()
    return counts[rows] if rows < len(counts) else rows


def half_row_counts() -> list[int]:
    """``counts[m]``: the row count a fp16 product of ``m`` rows runs on (``m`` itself, or the next count whose
    rows round as in a product of :data:`HALF_PROBE_ROWS` rows), for ``m`` in 0 .. HALF_PROBE_ROWS; larger
    products run unpadded. Probed once per process and torch thread count on a small random product (~30 ms)."""
    threads = torch.get_num_threads()
    if threads in _row_counts:
        return _row_counts[threads]
    gen = torch.Generator().manual_seed(0)
    packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(64, 128, generator=gen), None)
    x = torch.randn(HALF_PROBE_ROWS, 128, generator=gen)
    full = torch.ops.quantized.linear_dynamic_fp16(x, packed)
    consistent = [m == 0 or torch.equal(torch.ops.quantized.linear_dynamic_fp16(x[:m].contiguous(), packed), full[:m])
                  for m in range(HALF_PROBE_ROWS + 1)]
    counts, after = list(range(HALF_PROBE_ROWS + 1)), HALF_PROBE_ROWS
    if sum(consistent) >= HALF_PROBE_ROWS // 2:  # else the probe's own reference is the odd one out: pad nothing
        for m in range(HALF_PROBE_ROWS, -1, -1):
            after = m if consistent[m] else after
            counts[m] = after
    _row_counts[threads] = counts
    return counts


def check_unchanged(source: torch.Tensor, key: tuple[int, int | None], weights: str) -> None:
    """RuntimeError if the dense parameter ``source`` is no longer what it was (``key``: its :func:`tensor_identity`)
    when it was packed to ``weights``: a product never runs on stale weights."""
    if tensor_identity(source) != key:
        raise RuntimeError(f"the target's weights changed after they were packed to {weights}; reload the target "
                           f"(or use target.weights=dense)")


def tensor_identity(tensor: torch.Tensor) -> tuple[int, int | None]:
    """(storage address, version) of ``tensor``; an inference tensor keeps no version (it cannot change in place
    outside inference mode)."""
    return tensor.data_ptr(), None if tensor.is_inference() else tensor._version
