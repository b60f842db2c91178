"""models/native.py and q4q8.c: the Q4_1 x Q8_1 kernel built at first use, its arithmetic against a torch
emulation, row and thread independence, and the same results from every build (AVX-512 VNNI, AVX2, portable)."""

from __future__ import annotations

import pytest
import torch

from taps_ray.models import native
from taps_ray.models.quant import GROUP, Int4Weight, Q4Q8Linear, Q8Q8Linear, q4q8_unsupported, quantize_rtn

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler: q4q8 is refused (tested below)")


def emulated(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """The kernel's arithmetic in float64 torch: x quantized per row and group of 32 to int8 (round half to even),
    integer dots per group, scaled by the fp16 scale and minimum."""
    m, k = x.shape
    groups = x.float().reshape(m, k // GROUP, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv).double()  # [M, G, 32]
    dx = (amax / 127.0).double()[..., 0]  # [M, G]
    sx = dx * xq.sum(-1)
    codes = weight.codes.double().reshape(weight.codes.shape[0], -1, GROUP)  # [N, G, 32]
    dots = torch.einsum("mgj,ngj->mng", xq, codes)
    scale, minimum = weight.scale.half().double(), weight.minimum.half().double()
    return (dots * scale[None] * dx[:, None] + minimum[None] * sx[:, None]).sum(-1)


@pytest.fixture(scope="module")
def weight() -> Int4Weight:
    torch.manual_seed(0)
    return quantize_rtn(torch.randn(96, 160) * 0.05)


@needs_cc
def test_the_kernel_builds_once_into_the_cache_and_names_its_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    assert native.q4q8_kernel() in ("avx512-vnni", "avx2", "portable")
    built = list((tmp_path / "kernels").glob("q4q8-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    native.q4q8_library()
    assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("q4q8-*.so")] == [stamp]


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_q4_1_times_q8_1(weight, dtype):
    x = (torch.randn(7, 160) * torch.linspace(0.1, 3.0, 160)).to(dtype)
    x[2, 32:64] = 0.0  # a group of zeros: no scale, no NaN
    bias = torch.randn(96)
    linear = Q4Q8Linear(weight, bias, torch.zeros(1))
    got = linear(x).double()
    expected = emulated(x, weight) + bias.double()
    rounding = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((got - expected).abs().max()) <= rounding * float(expected.abs().max())
    exact = x.double() @ weight.dequantize().double().T + bias.double()
    assert float((got - exact).abs().max()) <= 0.02 * float(exact.abs().max())  # int8 activations: ~1/254 a group
    assert got.dtype == torch.float64 and linear(x).dtype == dtype


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads(weight, dtype):
    linear = Q4Q8Linear(weight, None, torch.zeros(1))
    x = torch.randn(11, 160).to(dtype)
    together = linear(x)
    for rows in (1, 2, 3, 4, 5, 9):
        assert torch.equal(torch.cat([linear(x[i:i + rows]) for i in range(0, 11, rows)]), together), rows
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(linear(x), together)
    finally:
        torch.set_num_threads(before)


@needs_cc
def test_every_build_computes_the_same_bits(weight, tmp_path, monkeypatch):
    """The AVX-512 VNNI, AVX2 and portable loops round alike: each kind of machine gets one answer (the AVX2 kind
    runs the AVX2 build; this machine checks every build its CPU can run, built as $TAPS_KERNEL_MARCH says)."""
    flags = set(native._cpu_flags().split())
    builds = {"x86-64": "portable"} if "sse2" in flags else {}
    if {"avx2", "fma", "f16c"} <= flags:
        builds["haswell"] = "avx2"
    x, bias = torch.randn(6, 160), torch.randn(96)
    reference = [Q4Q8Linear(weight, bias, torch.zeros(1))(x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    for march, kernel in builds.items():
        monkeypatch.setenv(native.MARCH_ENV, march)
        monkeypatch.setattr(native, "_library", None)
        monkeypatch.setattr(native, "_failure", None)
        assert native.q4q8_kernel() == kernel
        linear = Q4Q8Linear(weight, bias, torch.zeros(1))
        assert all(torch.equal(linear(x.to(ref.dtype)), ref) for ref in reference), kernel
    assert len(list((tmp_path / "kernels").glob("q4q8-*.so"))) == len(builds)


@needs_cc
def test_the_head_product_is_q8_0_times_q8_1_in_every_build(tmp_path, monkeypatch):
    """Q8Q8Linear (a q4q8 engine's LM head): round-to-nearest int8 codes per group of 32 with an fp16 scale, times
    the activations' int8 codes; emulated in float64, alone per row, and the same bits from every build."""
    torch.manual_seed(1)
    dense = torch.randn(64, 96) * 0.1
    dense[3, :32] = 0.0  # a group of zero weights: scale 0, no NaN
    bias = torch.randn(64)
    x = torch.randn(7, 96) * torch.linspace(0.1, 3.0, 96)
    head = Q8Q8Linear(dense, bias)
    got = head(x).double()
    groups = dense.reshape(64, 3, GROUP)
    scale = (groups.abs().amax(-1) / 127).half().double()
    codes = torch.where(scale[..., None] > 0, groups.double() / scale[..., None].clamp(min=1e-30), 0.0).round()
    xg = x.reshape(7, 3, GROUP).double()
    amax = xg.abs().amax(-1, keepdim=True)
    xq = torch.round(xg.float() * torch.where(amax > 0, 127.0 / amax, 0.0).float()).double()
    expected = (torch.einsum("mgj,ngj->mng", xq, codes) * scale[None] * (amax[..., 0] / 127)[:, None]).sum(-1)
    expected = expected + bias.double()
    assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    assert torch.equal(torch.cat([head(x[i:i + 1]) for i in range(7)]), head(x))
    flags = set(native._cpu_flags().split())
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    for march, kernel in {"x86-64": "portable", "haswell": "avx2"}.items():
        if kernel == "avx2" and not {"avx2", "fma", "f16c"} <= flags:
            continue
        monkeypatch.setenv(native.MARCH_ENV, march)
        monkeypatch.setattr(native, "_library", None)
        monkeypatch.setattr(native, "_failure", None)
        assert native.q4q8_kernel() == kernel
        assert torch.equal(Q8Q8Linear(dense, bias)(x), got.float()), kernel


def test_shapes_the_kernel_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        Q4Q8Linear(quantize_rtn(torch.randn(40, 64)), None, torch.zeros(1))


@needs_cc
def test_a_weight_changed_after_packing_is_an_error(weight):
    source = torch.zeros(3)
    linear = Q4Q8Linear(weight, None, source)
    source.add_(1.0)
    with pytest.raises(RuntimeError, match="changed after they were packed to q4q8"):
        linear(torch.randn(1, 160))


@needs_cc
def test_a_compiler_without_openmp_builds_a_one_thread_kernel_and_a_failing_one_is_refused(monkeypatch, tmp_path):
    """A compiler that rejects -fopenmp (clang without libomp) still builds the kernel, single-threaded; one that
    builds nothing makes q4q8 unsupported with the compiler's words, so ``auto`` falls back to int4."""
    real = native.compiler()
    wrapper = tmp_path / "cc-no-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && echo "unsupported: -fopenmp" >&2 && exit 1; done\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    assert native.q4q8_kernel() in ("avx512-vnni", "avx2", "portable")
    broken = tmp_path / "cc-broken"
    broken.write_text('#!/bin/sh\necho "fatal: nothing builds here" >&2\nexit 1\n')
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    assert "does not build here" in q4q8_unsupported(torch.device("cpu"), torch.bfloat16)


@needs_cc
def test_a_cache_that_cannot_be_written_refuses_q4q8_once_with_the_reason(monkeypatch, tmp_path):
    """The build's OSError becomes the refusal's reason (an fp16 target then drafts on half weights), and the
    process does not try to build again."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TAPS_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    reason = q4q8_unsupported(torch.device("cpu"), torch.float32)
    assert reason is not None and "cannot be built into the cache" in reason
    tries: list[int] = []
    monkeypatch.setattr(native, "_built", lambda: tries.append(1))
    assert q4q8_unsupported(torch.device("cpu"), torch.float32) == reason and not tries


@needs_cc
def test_a_coded_product_refuses_an_input_of_another_width(weight):
    linear = Q4Q8Linear(weight, None, weight.dequantize())
    with pytest.raises(ValueError, match=rf"CPU inputs \[T, {weight.codes.shape[1]}\], got \[2, 64\]"):
        linear(torch.randn(2, 64))


def test_without_a_compiler_q4q8_is_refused_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    assert "C compiler" in q4q8_unsupported(torch.device("cpu"), torch.float32)
    with pytest.raises(native.KernelBuildError, match="no-such-cc"):
        native.q4q8_library()
    assert "CPU kernel only" in q4q8_unsupported(torch.device("cuda"), torch.float32)
    assert "float16" in q4q8_unsupported(torch.device("cpu"), torch.float16)
