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


def test_drafter_linears_read_packed_weights_outside_autograd_and_follow_them():
    import copy
    import pickle

    from taps_ray.models.engine import PackedLinearForward, read_linears_packed

    module = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.SiLU(), torch.nn.Linear(48, 16, bias=False))
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        expected = module(x)
    read_linears_packed(module)
    read_linears_packed(module)  # idempotent
    forwards = [sub.__dict__["forward"] for sub in module if isinstance(sub, torch.nn.Linear)]
    assert all(isinstance(f, PackedLinearForward) for f in forwards)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
        if can_pack(torch.device("cpu"), torch.float32):
            assert forwards[0]._product is not None
    out = module(x)  # training path: autograd through F.linear, gradients reach the weights
    out.sum().backward()
    assert module[0].weight.grad is not None
    with torch.no_grad():
        module[0].weight.mul_(2.0)
        changed = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(
            x, module[0].weight, module[0].bias)), module[2].weight)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), changed, atol=1e-5, rtol=1e-5)
    for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert other[0].__dict__["forward"]._product is None
        with torch.inference_mode():
            torch.testing.assert_close(other(x), changed, atol=1e-5, rtol=1e-5)
