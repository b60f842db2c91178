"""A target request's KV cache (:data:`TargetCache`) and the two edits tree verification makes to it in
place: crop to a length, and compact the accepted path's entries onto the prefix. Either kind of cache
(the static engine's :class:`~taps_ray.models.engine.KVCache` or transformers' ``DynamicCache``), full-history
layers only.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from taps_ray.models.engine import KVCache

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
