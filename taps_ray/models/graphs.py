"""CUDA graphs of the static engine's small steps: a decode step or a tree verification of up to
:data:`BUCKETS`\\[-1] tokens on one request's cache runs as one captured graph, replayed.

A graph reads fixed addresses, so the step runs at a fixed shape: its n tokens padded to the next bucket
(1, 2, 4 ... 64 rows), attention over the cache's first S entries (S the next power of two from
:data:`MIN_SPAN` that holds the step) with an additive mask [rows, S] that hides the entries past the step
(the padding rows attend to their own entry only), the new keys and values written at ``length + i`` by
index. The query heads that share a key/value head attend as one group of rows, so the keys and values
are read once per step rather than repeated per query head. The caches are pooled: :meth:`StepGraphs.new_cache` hands out
one of :data:`CAPACITY` entries whose storage returns to the pool when the cache is collected, so the
graphs captured on it (one per bucket and feature-layer set, captured at first use) serve the next
request too. A step the graphs cannot take (several requests packed, more than 64 tokens, a sliding-window
target, a cache that outgrew its pooled storage) runs the eager forward.

``capture=False`` runs the same fixed-shape step eagerly (no graph): how the CPU tests check it against
the eager forward.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Protocol

import torch
import torch.nn.functional as F

from taps_ray.models.target_cache import KVCache, Segment

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CAPACITY = 4096
MIN_SPAN = 256


class Engine(Protocol):
    """What the graphs read of a :class:`~taps_ray.models.engine.StaticEngine` (which owns them)."""

    device: torch.device
    attention_dtype: torch.dtype
    layers: list
    heads: int
    kv_heads: int
    head_dim: int
    scale: float

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, total: int, attend,
               layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def span(entries: int, capacity: int = CAPACITY) -> int:
    """The cache entries a step attends over when ``entries`` are in use after it: a power of two from
    :data:`MIN_SPAN`, at most ``capacity``."""
    return min(capacity, max(MIN_SPAN, 1 << (entries - 1).bit_length()))


def bucket(n: int) -> int | None:
    """The row count a step of ``n`` tokens runs at, or None when no graph takes it."""
    return next((b for b in BUCKETS if b >= n), None)


class StepGraphs:
    """The captured steps of ``engine`` (a :class:`~taps_ray.models.engine.StaticEngine` on CUDA, no sliding
    windows) and the pool of caches they run on. ``captures`` / ``capture_s``: graphs captured so far and
    the seconds that took (kept out of any step's time by whoever reports it). Steps from several threads
    (a serving replica decodes requests concurrently) take turns: the static inputs are shared."""

    def __init__(self, engine: Engine, capture: bool = True, capacity: int = CAPACITY):
        self.engine, self.capture, self.capacity = engine, capture, capacity
        rows, device = BUCKETS[-1], engine.device
        self._tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self._positions = torch.zeros(rows, dtype=torch.long, device=device)
        self._writes = torch.zeros(rows, dtype=torch.long, device=device)
        self._mask = torch.zeros(rows, capacity, dtype=engine.attention_dtype, device=device)
        self._rows = torch.arange(rows, device=device)
        self._causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
        self._free: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pooled: set[int] = set()
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures, self.capture_s = 0, 0.0
        self._lock = threading.Lock()

    def new_cache(self) -> KVCache:
        """An empty cache on pooled storage of :attr:`capacity` entries (its storage goes back to the pool,
        graphs and all, once the cache is collected)."""
        with self._lock:
            if self._free:
                cache = KVCache.over(*self._free.pop())
            else:
                engine = self.engine
                cache = KVCache(len(engine.layers), engine.kv_heads, engine.head_dim, engine.attention_dtype,
                                engine.device, self.capacity)
                cache.keys.zero_(), cache.values.zero_()  # masked entries must be finite: 0 * NaN is NaN
                self._pooled.add(cache.keys.data_ptr())
        weakref.finalize(cache, self._free.append, (cache.keys, cache.values))
        return cache

    def applies(self, segments: list[Segment]) -> bool:
        if len(segments) != 1:
            return False
        seg = segments[0]
        rows = bucket(seg.n)
        return (rows is not None and seg.cache.keys.data_ptr() in self._pooled
                and seg.cache.length + rows <= seg.cache.capacity)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, seg: Segment,
            layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`~taps_ray.models.engine.StaticEngine.forward_layers` of one segment that :meth:`applies`."""
        with self._lock:
            return self._run(tokens, positions, seg, layers)

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, seg: Segment,
             layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, past = seg.n, seg.cache.length
        rows = bucket(n)
        assert rows is not None
        width = span(past + rows, self.capacity)
        self._stage(tokens, positions, seg, rows, width)
        if self.capture:
            key = (seg.cache.keys.data_ptr(), rows, width, layers)
            if key not in self._graphs:
                self._graphs[key] = self._record(seg.cache, rows, width, layers)
            graph, outputs = self._graphs[key]
            graph.replay()
        else:
            outputs = self._step(seg.cache, rows, width, layers)
        seg.cache.length = past + n
        final, features = outputs
        return final[:n].clone(), None if features is None else features[:n].clone()

    def _stage(self, tokens: torch.Tensor, positions: torch.Tensor, seg: Segment, rows: int, width: int) -> None:
        """Copy the step into the static inputs: tokens and positions (padding rows repeat the last), the
        cache slots ``length + i`` they write, and the mask: each real row sees the cache's valid entries and
        the step's own as the eager forward would (``seg.mask``, else causal), a padding row only itself."""
        n, past = seg.n, seg.cache.length
        self._tokens[:n].copy_(tokens)
        self._positions[:n].copy_(positions)
        if rows > n:
            self._tokens[n:rows].copy_(tokens[-1].expand(rows - n))
            self._positions[n:rows].copy_(positions[-1].expand(rows - n))
        torch.add(self._rows[:rows], past, out=self._writes[:rows])
        mask = self._mask[:rows, :width]
        mask.fill_(torch.finfo(mask.dtype).min)
        if seg.mask is not None:
            mask[:n, :past + n].copy_(seg.mask)
        else:
            mask[:n, :past].zero_()
            mask[:n, past:past + n].masked_fill_(self._causal[:n, :n], 0)
        if rows > n:
            pad = self._rows[n:rows]
            mask[pad, pad + past] = 0

    def _record(self, cache: KVCache, rows: int, width: int, layers: tuple[int, ...]):
        """The graph of a step of ``rows`` on ``cache``'s storage and its outputs. The warm-up pass writes the
        keys and values the replay writes again (same inputs, same slots)."""
        start = time.perf_counter()
        side = torch.cuda.Stream(self.engine.device)
        side.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(side):
            self._step(cache, rows, width, layers)
        torch.cuda.current_stream(self.engine.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._step(cache, rows, width, layers)
        torch.cuda.synchronize(self.engine.device)
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return graph, outputs

    def _step(self, cache: KVCache, rows: int, width: int,
              layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-shape step over the static inputs: last hidden states [rows, H] and features."""
        engine = self.engine
        x, cos, sin = engine.embed(self._tokens[:rows], self._positions[:rows])
        writes = self._writes[:rows]
        g, groups = engine.kv_heads, engine.heads // engine.kv_heads
        mask = self._mask[:rows, :width].repeat(groups, 1)  # [groups * rows, S]: group-major, as the queries

        def attend(index: int, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.keys[index], cache.values[index]
            keys.index_copy_(1, writes, k.transpose(0, 1).to(keys.dtype))
            values.index_copy_(1, writes, v.transpose(0, 1).to(values.dtype))
            grouped = q.transpose(0, 1).reshape(g, groups * rows, -1).to(keys.dtype)  # [g, groups * rows, d]
            out = F.scaled_dot_product_attention(grouped[None], keys[None, :, :width], values[None, :, :width],
                                                 attn_mask=mask, scale=engine.scale)
            return out[0].reshape(g * groups, rows, -1).transpose(0, 1).reshape(rows, -1).to(q.dtype)

        return engine.decode(x, cos, sin, rows, attend, layers)
