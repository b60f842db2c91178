"""models/decode_attention.py and decode_attention.c: one-token attention of a packed batch in one kernel call per
layer, equal to torch's SDPA within float32 rounding, and each request's bits independent of its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from taps_ray.models import decode_attention, native
from taps_ray.models.decode_attention import DecodeAttention, takes_kernel
from taps_ray.models.target_cache import KVCache, Segment

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the engine attends with SDPA (tested)")


def _caches(pasts: list[int], layers: int = 2, g: int = 3, d: int = 64, seed: int = 0) -> list[KVCache]:
    generator = torch.Generator().manual_seed(seed)
    caches = []
    for past in pasts:
        cache = KVCache(layers, g, d, torch.float32, torch.device("cpu"), capacity=past + 7)
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
        cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
        cache.length = past
        caches.append(cache)
    return caches


def _sdpa(cache: KVCache, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of ``q`` [h, d] over the cache's first length + 1 entries: [h, d]."""
    end = cache.length + 1
    out = F.scaled_dot_product_attention(q[None, :, None], cache.keys[layer, None, :, :end],
                                         cache.values[layer, None, :, :end], scale=scale, enable_gqa=True)
    return out[0, :, 0]


def _attend(caches: list[KVCache], layer: int, q, k, v, h: int, g: int, d: int, scale: float) -> torch.Tensor:
    kernel = DecodeAttention.plan([Segment(c, 1) for c in caches], list(range(len(caches))), h, g, d, scale)
    assert kernel is not None
    return kernel(layer, q, k, v)


@needs_cc
@pytest.mark.parametrize(("h", "g", "d"), [(9, 3, 64), (4, 4, 12), (8, 2, 20)])
def test_the_kernel_writes_the_new_entry_and_attends_as_sdpa(h, g, d):
    pasts = [0, 5, 40, 129]
    caches = _caches(pasts, g=g, d=d)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(len(pasts), heads, d, generator=generator) for heads in (h, g, g))
    out = _attend(caches, 1, q, k, v, h, g, d, d ** -0.5)
    for b, cache in enumerate(caches):
        assert torch.equal(cache.keys[1, :, pasts[b]], k[b]) and torch.equal(cache.values[1, :, pasts[b]], v[b])
        assert cache.length == pasts[b]  # the forward advances it
        torch.testing.assert_close(out[b], _sdpa(cache, 1, q[b], d ** -0.5), atol=2e-6, rtol=1e-5)


@needs_cc
def test_a_requests_bits_do_not_depend_on_its_batch_or_the_thread_count():
    pasts = [3, 17, 64, 200, 1, 90, 33, 150, 7, 120]
    h, g, d = 9, 3, 64
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(len(pasts), heads, d, generator=generator) for heads in (h, g, g))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = _attend(_caches(pasts), 0, q, k, v, h, g, d, 0.125)
        torch.set_num_threads(1)
        alone = torch.cat([_attend(_caches(pasts)[b:b + 1], 0, q[b:b + 1], k[b:b + 1], v[b:b + 1], h, g, d, 0.125)
                           for b in range(len(pasts))])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)


def test_only_one_token_steps_without_a_mask_on_a_float32_cpu_cache_take_the_kernel():
    cache = _caches([4])[0]
    assert takes_kernel(Segment(cache, 1))
    assert not takes_kernel(Segment(cache, 3))
    assert not takes_kernel(Segment(cache, 1, torch.zeros(1, 5)))
    half = KVCache(2, 3, 64, torch.bfloat16, torch.device("cpu"))
    assert not takes_kernel(Segment(half, 1))


def test_without_a_kernel_the_engine_attends_with_sdpa(monkeypatch):
    monkeypatch.setattr(decode_attention, "attention_library", lambda: None)
    assert DecodeAttention.plan([Segment(_caches([4])[0], 1)], [0], 9, 3, 64, 0.125) is None


@needs_cc
def test_a_packed_forward_of_plain_steps_and_trees_gives_each_request_its_own_forwards_bits(tiny_target, monkeypatch):
    """The engine's batch: one-token steps through the kernel (never SDPA), tree steps through SDPA; every row equals
    that request's forward alone."""
    engine = tiny_target.engine
    prompts = [torch.tensor([5, 9, 11, 3, 7][:n]) for n in (5, 2, 4)]

    def caches():
        made = []
        for ids in prompts:
            cache = engine.new_cache()
            engine.forward(ids, torch.arange(len(ids)), [Segment(cache, len(ids))])
            made.append(cache)
        return made

    steps = [torch.tensor([17]), torch.tensor([21, 22, 23]), torch.tensor([30])]
    tree = torch.zeros(3, len(prompts[1]) + 3)
    tree[0, -2:] = tree[1, -1] = tree[2, -2] = -torch.inf  # node 0, its children 1 and 2
    masks = [None, tree, None]
    positions = [torch.arange(len(p), len(p) + len(s)) for p, s in zip(prompts, steps, strict=True)]
    alone = [engine.forward(s, pos, [Segment(c, len(s), m)])
             for s, pos, c, m in zip(steps, positions, caches(), masks, strict=True)]
    fresh = caches()
    sdpa_rows = []
    real = engine._attend
    monkeypatch.setattr(engine, "_attend", lambda index, layer, seg, *a: sdpa_rows.append(seg.n) or real(
        index, layer, seg, *a))
    together = engine.forward(torch.cat(steps), torch.cat(positions),
                              [Segment(c, len(s), m) for s, c, m in zip(steps, fresh, masks, strict=True)])
    assert torch.equal(together, torch.cat(alone))
    assert set(sdpa_rows) == {3}  # the tree alone went through SDPA
