"""models/engine.py: the KVCache's bookkeeping and the prepacked products staying in step with their weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from taps_ray.models.engine import KVCache, Linear, can_pack


def _filled(n: int, capacity: int) -> KVCache:
    cache = KVCache(layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                    capacity=capacity)
    cache.reserve(n)
    values = torch.arange(n, dtype=torch.float32)[None, None, :, None].expand(2, 1, n, 2)
    cache.keys[:, :, :n] = values
    cache.values[:, :, :n] = -values
    cache.length = n
    return cache


def test_reserve_grows_the_capacity_and_keeps_the_entries():
    cache = _filled(5, capacity=4)
    assert cache.capacity >= 5
    cache.reserve(100)
    assert cache.capacity >= 105 and cache.length == 5
    assert cache.keys[0, 0, :5, 0].tolist() == [0, 1, 2, 3, 4]


def test_crop_and_compact_move_the_length_and_gather_by_index():
    cache = _filled(8, capacity=8)
    cache.compact(3, torch.tensor([0, 2, 4]))
    assert cache.get_seq_length() == 6
    assert cache.keys[1, 0, :6, 1].tolist() == [0, 1, 2, 3, 5, 7]
    assert cache.values[0, 0, :6, 0].tolist() == [0, -1, -2, -3, -5, -7]
    cache.crop(2)
    assert cache.length == 2 and [layer.keys.shape[-2] for layer in cache.layers] == [2, 2]


def test_packed_product_follows_its_weight():
    weight, bias = torch.randn(6, 4), torch.randn(6)
    linear = Linear(weight, bias, pack=can_pack(torch.device("cpu"), torch.float32))
    x = torch.randn(3, 4)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    weight.mul_(3.0)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_packing_on_cpu_for_float32_and_for_bfloat16_where_onednn_has_native_bf16():
    mkldnn = torch.backends.mkldnn.is_available()
    assert can_pack(torch.device("cpu"), torch.bfloat16) == (mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("cuda"), torch.float32)
    assert can_pack(torch.device("cpu"), torch.float32) == mkldnn


def test_packed_bfloat16_product_follows_its_weight():
    weight, bias = torch.randn(40, 32).to(torch.bfloat16), torch.randn(40).to(torch.bfloat16)
    linear = Linear(weight, bias, pack=can_pack(torch.device("cpu"), torch.bfloat16))
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=0.05, rtol=0.02)
        weight.mul_(2.0)
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=0.1, rtol=0.02)
