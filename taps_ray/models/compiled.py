"""The static engine's narrow int4 steps on CPU as one inductor-compiled forward (``target.compile``).

A plain int4 step of the embedded target spends about as long in ~25 small ops a layer (norms, rotary
embeddings, casts, residual adds, each a few microseconds of dispatch) as in its products. Compiled whole,
with inductor's C++ wrapper, those ops become a few fused C++ loops a layer and the step makes no Python
call per op. The products and attention stay torch's own kernels behind two opaque custom ops
(:func:`int4_product`, :func:`cache_attention`): inductor would lower the int4 product to a slower kernel,
and the attention writes the cache in place. Guards are kept on the step's inputs only; the weights are
checked by identity once a step instead (a change after packing is the same error as on the eager path).

A step compiles where it is one request's, on a non-empty cache, of at most :attr:`CompiledSteps.max_rows`
tokens; any other step (a prefill, a packed batch, a wider tree) runs eagerly. One graph for one-token steps
and one for trees (dynamic in rows and cache length) per feature-layer set, compiled at first use in a
process; inductor keeps the code on disk (``TORCHINDUCTOR_CACHE_DIR``), so a later process loads it.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch
import torch.nn.functional as F

from taps_ray.models.quant import GROUP, Int4Linear
from taps_ray.models.target_cache import Segment

INPUTS = ("x", "cos", "sin", "keys", "values", "past", "mask", "layers")


OPS = torch.library.Library("taps", "DEF")  # declared with the dispatcher's own API: torch.library.custom_op
# adds 85 us of Python bookkeeping to every call of an op that mutates its inputs, more than attention itself
OPS.define("int4_product(Tensor x, Tensor packed, Tensor scale_zero) -> Tensor")
OPS.define("cache_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) keys, Tensor(b!) values, int layer, Tensor past, "
           "Tensor? mask, float scale) -> Tensor")


def int4_product(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """``x`` [T, K] times the int4 weight (``packed`` codes, ``scale_zero`` [K / 32, N, 2]): [T, N]."""
    return torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, GROUP, scale_zero)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    layer: int, past: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Write ``k``/``v`` [n, g, d] at entries ``past .. past + n - 1`` of layer ``layer`` of ``keys``/``values``
    [L, g, C, d] and attend ``q`` [n, h, d] over entries ``0 .. past + n - 1`` with the additive ``mask``
    [n, past + n] (None: one query, no mask): [n, h, d] in ``q``'s dtype, as the eager engine attends."""
    start = int(past)
    end = start + q.shape[0]
    keys, values = keys[layer], values[layer]
    keys[:, start:end] = k.transpose(0, 1)
    values[:, start:end] = v.transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(keys.dtype), keys[None, :, :end], values[None, :, :end], attn_mask=mask,
        scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).to(q.dtype).contiguous()


OPS.impl("int4_product", int4_product, "CPU")
OPS.impl("cache_attention", cache_attention, "CPU")


@torch.library.register_fake("taps::int4_product", lib=OPS)
def _(x, packed, scale_zero):
    return x.new_empty(x.shape[0], scale_zero.shape[1])


@torch.library.register_fake("taps::cache_attention", lib=OPS)
def _(q, k, v, keys, values, layer, past, mask, scale):
    return torch.empty_like(q)


class Engine(Protocol):
    """What the compiled steps read of a :class:`~taps_ray.models.engine.StaticEngine` (which owns them)."""

    layers: list
    heads: int
    head_dim: int
    scale: float
    int4_max_rows: int | None

    def products(self) -> list: ...

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, total: int, attend, layers: tuple[int, ...],
               product=None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def _masks(self, seg: Segment, positions: torch.Tensor) -> dict: ...


def compile_support(engine) -> str | None:
    """Why :class:`CompiledSteps` cannot run ``engine``'s steps, or None when it can: a CPU engine on int4
    layer weights, Llama-style fused RMSNorms, no q/k norms, no sliding windows."""
    if engine.device.type != "cpu" or engine.weights != "int4":
        return f"compiled steps need int4 weights on a CPU target (device {engine.device}, weights {engine.weights})"
    for layer in engine.layers:
        if layer.window is not None:
            return "sliding-window layers"
        if layer.q_norm is not None:
            return "q/k norms"
        if not (layer.norm_in.fused and layer.norm_post.fused):
            return f"a norm that is not a Llama-style RMSNorm ({type(layer.norm_in.module).__name__})"
    if not all(isinstance(product, Int4Linear) for product in engine.products()):
        return "a layer product without int4 codes"
    return None


def _inputs_only(entries) -> list[bool]:
    """Keep dynamo's guards on the step's inputs and its shape constraints; drop those on the engine's weights."""
    return [not entry.name or entry.name.split("[", 1)[0].split(".", 1)[0] in INPUTS for entry in entries]


class CompiledSteps:
    """The compiled one-request steps of ``engine`` (one :func:`compile_support` accepts). ``compiles`` /
    ``compile_s``: graphs compiled in this process and the seconds they took (first calls of a new shape; kept
    out of any step's time by whoever reports it). Steps from several threads take turns."""

    max_rows_without_wide = 16

    def __init__(self, engine: Engine):
        self.engine = engine
        self._products = engine.products()
        self._step = torch.compile(self._decode, fullgraph=True,
                                   options={"cpp_wrapper": True, "guard_filter_fn": _inputs_only})
        self._seen: set[tuple] = set()
        self.compiles, self.compile_s = 0, 0.0
        self._lock = threading.Lock()

    @property
    def max_rows(self) -> int:
        """The widest step compiled: the rows up to which the layers read their int4 codes."""
        rows = self.engine.int4_max_rows
        return self.max_rows_without_wide if rows is None else rows

    def applies(self, segments: list[Segment]) -> bool:
        return len(segments) == 1 and segments[0].cache.length > 0 and segments[0].n <= self.max_rows

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, seg: Segment,
            layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`~taps_ray.models.engine.StaticEngine.forward_layers` of one segment that :meth:`applies`."""
        for product in self._products:
            product.check()
        cache = seg.cache
        cache.reserve(seg.n)
        x, cos, sin = self.engine.embed(tokens, positions)
        mask = None if seg.n == 1 and seg.mask is None else self.engine._masks(seg, positions)["full"]
        for tensor in (cache.keys, cache.values):
            torch._dynamo.mark_dynamic(tensor, 2)
        if mask is not None:
            torch._dynamo.mark_dynamic(mask, 1)
        if seg.n > 1:
            for tensor in (x, cos, sin, mask):
                torch._dynamo.mark_dynamic(tensor, 0)
        shape = (seg.n > 1, mask is not None, layers)
        with self._lock:
            start = time.perf_counter()
            out = self._step(x, cos, sin, cache.keys, cache.values, torch.tensor(cache.length), mask, layers)
            if shape not in self._seen:
                self._seen.add(shape)
                self.compiles += 1
                self.compile_s += time.perf_counter() - start
        cache.length += seg.n
        return out

    def _decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, past: torch.Tensor, mask: torch.Tensor | None,
                layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        engine = self.engine
        total, hd = x.shape[0], engine.heads * engine.head_dim

        def attend(index: int, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.ops.taps.cache_attention(q, k, v, keys, values, index, past, mask, engine.scale).reshape(total, hd)

        def product(linear: Int4Linear, rows: torch.Tensor) -> torch.Tensor:
            out = torch.ops.taps.int4_product(rows, linear.packed, linear.scale_zero)
            return out if linear.bias is None else out + linear.bias

        return engine.decode(x, cos, sin, total, attend, layers, product)
