"""A target request's KV cache (:data:`TargetCache`) and the two edits tree verification makes to it in
place: crop to a length, and compact the accepted path's entries onto the prefix. Either kind of cache
(the static engine's preallocated :class:`KVCache`, defined here, or transformers' ``DynamicCache``),
full-history layers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class KVCache:
    """One request's keys and values for every layer, preallocated: ``keys``/``values`` [L, g, C, d];
    entries ``0 .. length - 1`` are valid. The capacity doubles when a step needs more (amortised)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256):
        shape = (layers, kv_heads, max(1, capacity), head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor) -> KVCache:
        """An empty cache on the given storage ``keys``/``values`` [L, g, C, d]."""
        cache = cls.__new__(cls)
        cache.keys, cache.values, cache.length = keys, values, 0
        return cache

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more entries after ``length``."""
        need = self.length + n
        if need <= self.capacity:
            return
        shape = (*self.keys.shape[:2], max(need, 2 * self.capacity), self.keys.shape[3])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(shape)
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    def crop(self, length: int) -> None:
        """Keep entries ``0 .. length - 1``."""
        self.length = min(self.length, max(0, length))

    def compact(self, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep the prefix plus the entries at ``prefix_len + keep`` (``keep`` [k] ascending), moved to
        ``prefix_len .. prefix_len + k - 1``: one gather and one write for all layers."""
        index = keep.to(device=self.keys.device, dtype=torch.long) + prefix_len
        k = index.numel()
        for tensor in (self.keys, self.values):
            tensor[:, :, prefix_len:prefix_len + k] = tensor.index_select(2, index)
        self.length = prefix_len + k

    @property
    def layers(self) -> list[CacheLayer]:
        """Per layer, views of its valid keys and values [1, g, length, d] (read-only use)."""
        return [CacheLayer(self.keys[i, None, :, :self.length], self.values[i, None, :, :self.length])
                for i in range(self.keys.shape[0])]


@dataclass
class CacheLayer:
    """One layer's valid cache entries: ``keys``/``values`` [1, g, P, d]."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class Segment:
    """One request's part of a packed forward: ``n`` tokens on top of ``cache`` with an additive ``mask``
    [n, P + n] (None: causal among themselves)."""

    cache: KVCache
    n: int
    mask: torch.Tensor | None = None


TargetCache = KVCache | DynamicCache
"""A target request's KV cache: the static engine's preallocated one, or transformers' dynamic one."""


def _full_history_layers(cache: DynamicCache) -> None:
    """ValueError naming the first layer that is not a plain :class:`DynamicLayer` (a sliding-window layer
    drops entries and counts positions apart from its buffer, so slicing its keys/values is wrong)."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(f"cache layer {i} is a {type(layer).__name__}; crop/compact need full-history "
                             f"DynamicLayer layers (TargetModel.new_cache, DynamicCache() without a config)")


@torch.inference_mode()
def crop_cache(cache: TargetCache, length: int) -> None:
    """Drop every cache entry at position >= ``length`` (in place); full-history layers only."""
    if isinstance(cache, KVCache):
        cache.crop(length)
        return
    _full_history_layers(cache)
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


@torch.inference_mode()
def compact_cache(cache: TargetCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Keep the prefix plus the entries at ``prefix_len + keep`` (``keep`` [k], ascending), in place.

    Used after tree verification: the tree's N entries sit after the prefix; only the accepted
    path's k entries stay, moved to positions ``prefix_len .. prefix_len + k - 1``. Full-history
    layers only (ValueError otherwise).
    """
    if isinstance(cache, KVCache):
        cache.compact(prefix_len, keep)
        return
    _full_history_layers(cache)
    k = keep.numel()
    index = keep.to(torch.long) + prefix_len
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        kept_k = layer.keys.index_select(-2, index.to(layer.keys.device))
        kept_v = layer.values.index_select(-2, index.to(layer.values.device))
        keys = layer.keys[..., : prefix_len + k, :]
        values = layer.values[..., : prefix_len + k, :]
        keys[..., prefix_len:, :] = kept_k
        values[..., prefix_len:, :] = kept_v
        layer.keys, layer.values = keys, values
