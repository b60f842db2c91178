"""One-token attention of a packed batch on CPU: every plain-step request of a forward in one kernel call per layer.

A packed forward of B requests that each add one token (plain decoding, batched regeneration, a served batch)
attends per request on that request's own cache. Through torch that is 2B cache writes and B SDPA calls per layer,
whose fixed costs outweigh the arithmetic (``benchmarks/bench_batch_forward.py --attention --compare-sdpa``). The
kernel writes each request's new key and value into its cache and attends, one thread
per (request, head) in a fixed order, so a request's bits do not depend on the batch it is in, nor on the thread
count: the engine takes this path for every such request, alone or batched, and SDPA for every other.
"""

from __future__ import annotations

import torch

from taps_ray.models.native import attention_library
from taps_ray.models.target_cache import Segment


def takes_kernel(seg: Segment) -> bool:
    """Whether ``seg``'s attention runs in the kernel: one new token, no mask of its own, a contiguous float32
    cache on the CPU."""
    keys = seg.cache.keys
    return (seg.n == 1 and seg.mask is None and keys.dtype == torch.float32 and keys.device.type == "cpu"
            and keys.is_contiguous() and seg.cache.values.is_contiguous())


class DecodeAttention:
    """The kernel's view of one packed forward's kernel segments, built after their caches reserved room.

    ``rows`` [B]: each kernel segment's row in the packed forward; :meth:`__call__` attends them at one layer."""

    def __init__(self, segments: list[Segment], rows: list[int], heads: int, kv_heads: int, head_dim: int,
                 scale: float):
        self.lib = attention_library()
        self.taken = set(rows)  # the kernel segments' first rows
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.keys = torch.tensor([seg.cache.keys.data_ptr() for seg in segments], dtype=torch.int64)
        self.values = torch.tensor([seg.cache.values.data_ptr() for seg in segments], dtype=torch.int64)
        self.capacity = torch.tensor([seg.cache.capacity for seg in segments], dtype=torch.int64)
        self.past = torch.tensor([seg.cache.length for seg in segments], dtype=torch.int64)
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale

    @classmethod
    def plan(cls, segments: list[Segment], starts: list[int], heads: int, kv_heads: int, head_dim: int,
             scale: float) -> DecodeAttention | None:
        """The kernel's part of a forward over ``segments`` (starting at rows ``starts``), or None when no segment
        takes the kernel or it cannot be built here."""
        chosen = [(seg, start) for seg, start in zip(segments, starts, strict=True) if takes_kernel(seg)]
        if not chosen or attention_library() is None:
            return None
        return cls([seg for seg, _ in chosen], [start for _, start in chosen], heads, kv_heads, head_dim, scale)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write ``k``, ``v`` [B, g, d] into the segments' caches at ``layer`` and attend ``q`` [B, h, d] over them:
        [B, h, d] in ``q``'s dtype. The caches' lengths are the forward's to advance."""
        query, key, value = (t.to(torch.float32).contiguous() for t in (q, k, v))
        out = torch.empty_like(query)
        failed = self.lib.taps_decode_attention(
            len(self.rows), self.keys.data_ptr(), self.values.data_ptr(), self.capacity.data_ptr(),
            self.past.data_ptr(), layer, self.heads, self.kv_heads, self.head_dim, query.data_ptr(), key.data_ptr(),
            value.data_ptr(), self.scale, out.data_ptr(), torch.get_num_threads())
        if failed:
            raise MemoryError("decode attention: no memory for the attention scores")
        return out.to(q.dtype)
