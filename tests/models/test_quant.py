"""models/quant.py: 4-bit codes (GGUF Q4_1 blocks, round-to-nearest), the int4 and fp16 products of the static engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taps_ray.config import TargetConfig, TreeConfig
from taps_ray.models.engine import Linear, StaticEngine, can_pack
from taps_ray.models.quant import (
    GROUP,
    HALF_PROBE_ROWS,
    INT4_MAX_ROWS,
    HalfLinear,
    Int4Linear,
    Int4Weight,
    Q4Q8Linear,
    _q4_1_blocks,
    _unpermute_rope_rows,
    auto_weights,
    fp16_unsupported,
    half_row_counts,
    int4_unsupported,
    q4q8_unsupported,
    quantize_rtn,
    read_gguf_q4_1,
)
from taps_ray.models.target import TargetLoadError, TargetModel
from tests.conftest import make_tiny_int4_target, make_tiny_target


def _q4_1_like(n: int, k: int, seed: int = 0) -> Int4Weight:
    """Random codes as llama.cpp's Q4_1 quantizer leaves them: every group holds a 0 and a 15."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes[:, ::GROUP], codes[:, 1::GROUP] = 0, 15
    scale = torch.rand(n, k // GROUP, generator=gen) * 0.02 + 1e-3
    minimum = -torch.rand(n, k // GROUP, generator=gen) * 0.1
    return Int4Weight(codes, scale, minimum)


def test_rtn_recovers_the_codes_of_a_q4_1_weight():
    weight = _q4_1_like(8, 96)
    again = quantize_rtn(weight.dequantize())
    assert torch.equal(again.codes, weight.codes)
    torch.testing.assert_close(again.dequantize(), weight.dequantize(), rtol=0, atol=1e-6)


def test_q4_1_blocks_read_scale_minimum_and_both_nibbles():
    codes = np.arange(32, dtype=np.uint8) % 16
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), np.array([-2.0], np.float16).view(np.uint8),
                            (codes[:16] | (codes[16:] << 4)).astype(np.uint8)])
    weight = _q4_1_blocks(np.stack([block, block[::1]]), rows=2, cols=32)
    assert weight.codes[0].tolist() == codes.tolist()
    assert weight.scale.tolist() == [[0.5], [0.5]] and weight.minimum.tolist() == [[-2.0], [-2.0]]
    assert weight.dequantize()[0, 3].item() == pytest.approx(0.5 * 3 - 2.0)


def test_rope_rows_are_reordered_as_transformers_reorders_the_dense_weight():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = _q4_1_like(24, 64)  # 3 heads of 8 rows
    ours = _unpermute_rope_rows(weight, heads=3).dequantize().numpy()
    theirs = LlamaTensorProcessor({"num_attention_heads": 3, "num_key_value_heads": 3})._reverse_permute_weights(
        weight.dequantize().numpy(), 3, 3)
    np.testing.assert_array_equal(ours, theirs)


def test_int4_product_is_the_dequantized_weights_product_within_bf16_rounding():
    weight, bias = _q4_1_like(96, 64), torch.randn(96).to(torch.bfloat16)
    source = torch.zeros(1)
    linear = Int4Linear(weight, bias, torch.bfloat16, source)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        out = linear(x.to(torch.bfloat16))
    exact = x @ weight.dequantize().T + bias.float()
    assert out.shape == (5, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, rtol=0.02, atol=0.02 * float(exact.abs().max()))
    source.add_(1.0)
    with pytest.raises(RuntimeError, match="changed after they were packed"):
        linear(x.to(torch.bfloat16))


def test_int4_runs_where_its_kernel_pays_and_says_why_elsewhere(monkeypatch):
    assert int4_unsupported(torch.device("cpu"), torch.bfloat16) is None
    assert "bfloat16 activations" in int4_unsupported(torch.device("cpu"), torch.float32)
    assert "CPU kernel only" in int4_unsupported(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr("taps_ray.models.target_loading.cpu_native_bf16", lambda: None)
    assert auto_weights(torch.device("cpu"), torch.bfloat16) == "dense"
    monkeypatch.setattr("taps_ray.models.target_loading.cpu_native_bf16", lambda: "avx512_bf16")
    monkeypatch.setattr("taps_ray.models.quant.q4q8_unsupported", lambda device, dtype: "no C compiler")
    assert auto_weights(torch.device("cpu"), torch.bfloat16) == "int4"
    monkeypatch.setattr("taps_ray.models.quant.q4q8_unsupported", lambda device, dtype: None)
    assert auto_weights(torch.device("cpu"), torch.bfloat16) == "q4q8"
    assert auto_weights(torch.device("cpu"), torch.float32, "float32") == "dense"


def test_int4_engine_of_a_tiny_target_follows_its_dense_forward():
    """Round-to-nearest codes of a tiny Llama (no GGUF): the int4 engine's logits stay close to the dense
    float32 forward of the weights the codes stand for (a wiring mistake, such as fused q/k/v in the wrong
    order, would not)."""
    dense = make_tiny_target(0)
    with torch.no_grad():
        for layer in dense.model.model.layers:
            for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                module.weight.copy_(quantize_rtn(module.weight).dequantize())
    int4 = make_tiny_target(0)
    int4.model.load_state_dict(dense.model.state_dict())
    int4 = TargetModel(int4.model.to(torch.bfloat16), None, "tiny-int4", weights="int4")
    assert int4.weights == "int4"
    ids = torch.arange(3, 19)[None]
    with torch.inference_mode():
        reference = dense.prefill(ids).logits
        logits = int4.prefill(ids).logits
    error = float((logits - reference).abs().max())
    assert error < 0.05 * float(reference.abs().max()), error
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_int4_is_refused_with_a_reason_where_it_cannot_run():
    with pytest.raises(TargetLoadError, match="bfloat16 activations"):
        TargetModel.load(TargetConfig(dtype="float32", weights="int4"))
    tiny = make_tiny_target(0)
    with pytest.raises(TargetLoadError, match="static engine"):
        TargetModel(tiny.model, None, "tiny", engine="hf", weights="int4", weights_required=True)


needs_fbgemm = pytest.mark.skipif(fp16_unsupported(torch.device("cpu"), torch.float32) is not None,
                                  reason="this torch has no fbgemm fp16 GEMM on this CPU (non-x86)")


@needs_fbgemm
def test_half_product_rows_do_not_depend_on_how_many_rows_share_the_step():
    """Bitwise, for every row count a step can have: fbgemm's one- and two-row blocks round otherwise than its
    larger ones; the probed padding makes a plain step's row equal to the same row inside any tree step."""
    weight, bias = torch.randn(320, 576) * 0.05, torch.randn(320)
    linear = HalfLinear(weight, bias)
    x = torch.randn(HALF_PROBE_ROWS, 576)
    counts = half_row_counts()
    assert len(counts) == HALF_PROBE_ROWS + 1 and all(m <= c for m, c in enumerate(counts))
    with torch.inference_mode():
        full = linear(x)
        for rows in range(1, HALF_PROBE_ROWS):
            assert torch.equal(linear(x[:rows]), full[:rows]), rows
    assert full.dtype == torch.float32 and full.shape == (HALF_PROBE_ROWS, 320)


@needs_fbgemm
def test_half_product_is_the_half_rounded_weights_product_and_refuses_a_changed_weight():
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    linear = HalfLinear(weight, bias)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        out = linear(x)
    rounded = x @ weight.half().float().T + bias
    torch.testing.assert_close(out, rounded, rtol=0, atol=1e-5)
    assert float((out - (x @ weight.T + bias)).abs().max()) > 0  # the weights really are half precision
    assert linear.read_proxy().dtype == torch.float16 and linear.read_proxy().numel() == weight.numel()
    weight.add_(1.0)
    with pytest.raises(RuntimeError, match="changed after they were packed"):
        linear(x)


@pytest.mark.slow
def test_fp16_runs_where_fbgemm_does_and_auto_picks_it_only_from_dtype_auto(monkeypatch):
    assert "CPU kernel only" in fp16_unsupported(torch.device("cuda"), torch.float32)
    assert "float32 activations" in fp16_unsupported(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(TargetLoadError, match="float32 activations"):
        TargetModel.load(TargetConfig(dtype="bfloat16", weights="fp16"))
    monkeypatch.setattr("taps_ray.models.target_loading.cpu_native_bf16", lambda: None)
    monkeypatch.setattr("taps_ray.models.quant.fp16_unsupported", lambda device, dtype: None)
    assert auto_weights(torch.device("cpu"), torch.float32, "auto") == "fp16"
    assert auto_weights(torch.device("cpu"), torch.float32, "float32") == "dense"
    monkeypatch.setattr("taps_ray.models.quant.fp16_unsupported", lambda device, dtype: "no fbgemm")
    assert auto_weights(torch.device("cpu"), torch.float32, "auto") == "dense"


@pytest.mark.slow
@needs_fbgemm
@pytest.mark.parametrize("seed", range(3))
def test_fp16_engine_greedy_speculation_equals_its_vanilla_bitwise(seed):
    """The fp16 engine is its own exact reference: greedy speculation (tree steps of 2-40 rows) emits vanilla's
    tokens (one-row steps), and its logits follow the dense float32 forward within half rounding."""
    from taps_ray.models.drafter import DraftHead
    from taps_ray.spec.decoder import generate
    from taps_ray.spec.protocol import SingleStrategy
    from tests.spec.spec_helpers import OracleStrategy, peaky_tiny_target, random_prompt

    dense = peaky_tiny_target(seed)
    half = TargetModel(dense.model, None, "peaky-fp16", weights="fp16")
    assert half.weights == "fp16" and half.precision == "float32, fp16 weights" and not half.exact_reference
    prompt = random_prompt(half, 6 + seed, seed)
    with torch.inference_mode():
        error = float((half.prefill(prompt[None]).logits - dense.prefill(prompt[None]).logits).abs().max())
    assert 0 < error < 0.05
    vanilla = generate(half, prompt, max_new_tokens=48)
    sequence = torch.cat([prompt, torch.tensor(vanilla.token_ids)])
    for strategy in (SingleStrategy(DraftHead(half.config, seed=seed), TreeConfig(depth=3, top_k=4, total_tokens=24,
                                                                                 lookup_tokens=0)),
                     OracleStrategy(sequence, half.vocab_size, depth=5, seed=seed)):
        spec = generate(half, prompt, strategy, max_new_tokens=48)
        assert spec.token_ids == vanilla.token_ids


needs_cc = pytest.mark.skipif(q4q8_unsupported(torch.device("cpu"), torch.float32) is not None,
                             reason="no C compiler to build the q4q8 kernel with")


@pytest.mark.slow
@needs_cc
@pytest.mark.parametrize("seed, dtype", [(0, torch.float32), (1, torch.float32), (2, torch.bfloat16)])
def test_q4q8_engine_greedy_speculation_equals_its_vanilla_bitwise(seed, dtype):
    """The q4q8 engine is its own exact reference: greedy speculation (tree steps of 2-40 rows) emits vanilla's
    tokens (one-row steps), and its logits follow the dense forward of the codes' values within int8 activation
    rounding."""
    from taps_ray.models.drafter import DraftHead
    from taps_ray.spec.decoder import generate
    from taps_ray.spec.protocol import SingleStrategy
    from tests.spec.spec_helpers import OracleStrategy, peaky_tiny_target, random_prompt

    dense = peaky_tiny_target(seed)
    with torch.no_grad():
        for name, param in dense.model.named_parameters():
            if name.endswith("proj.weight"):
                param.copy_(quantize_rtn(param).dequantize())
    model = peaky_tiny_target(seed).model
    model.load_state_dict(dense.model.state_dict())
    q4q8 = TargetModel(model.to(dtype), None, "peaky-q4q8", weights="q4q8")
    assert q4q8.weights == "q4q8" and q4q8.precision.endswith("q4q8 weights") and not q4q8.exact_reference
    assert q4q8.engine.products() and all(isinstance(p, Q4Q8Linear) for p in q4q8.engine.products())
    prompt = random_prompt(q4q8, 6 + seed, seed)
    with torch.inference_mode():
        reference = dense.prefill(prompt[None]).logits
        error = float((q4q8.prefill(prompt[None]).logits.float() - reference).abs().max())
    assert 0 < error < 0.05 * float(reference.abs().max())
    vanilla = generate(q4q8, prompt, max_new_tokens=48)
    sequence = torch.cat([prompt, torch.tensor(vanilla.token_ids)])
    for strategy in (SingleStrategy(DraftHead(q4q8.config, seed=seed).to(dtype),
                                    TreeConfig(depth=3, top_k=4, total_tokens=24, lookup_tokens=0)),
                     OracleStrategy(sequence, q4q8.vocab_size, depth=5, seed=seed)):
        spec = generate(q4q8, prompt, strategy, max_new_tokens=48)
        assert spec.token_ids == vanilla.token_ids


@pytest.mark.integration
def test_the_embedded_ggufs_q4_1_codes_are_exactly_its_float32_weights(embedded_target):
    """The codes the int4 engine runs are the GGUF's own: dequantized, every layer projection equals the
    float32 copy transformers made of the same file (largest difference 0, docs/BENCHMARKS.md)."""
    from taps_ray import artifacts

    codes = read_gguf_q4_1(artifacts.fetch("smollm2-135m"), embedded_target.config)
    params = dict(embedded_target.model.named_parameters())
    assert len(codes) == 7 * embedded_target.config.num_hidden_layers
    assert max(float((w.dequantize() - params[name]).abs().max()) for name, w in codes.items()) == 0.0


@pytest.mark.integration
def test_the_gguf_header_index_agrees_with_the_gguf_package():
    from gguf import GGUFReader

    from taps_ray import artifacts
    from taps_ray.models.quant import gguf_tensor_index

    path = artifacts.fetch("smollm2-135m")
    arch, index = gguf_tensor_index(path)
    reader = GGUFReader(str(path))
    assert arch == "llama" and len(index) == len(reader.tensors)
    for tensor in reader.tensors:
        assert index[tensor.name] == (int(tensor.tensor_type), tuple(int(x) for x in tensor.shape),
                                      int(tensor.data_offset)), tensor.name


@needs_fbgemm
def test_a_drafter_of_an_fp16_target_reads_its_linears_in_half_outside_autograd_only(monkeypatch):
    """After drafting for an fp16 target where the q4q8 kernel cannot run, the drafter's linears compute on half
    weights without autograd, follow in-place weight changes (hot swap), train through F.linear as before, and
    pickle without the packed copy."""
    from taps_ray.models.drafter import DraftHead
    from taps_ray.models.quant import HalfLinearForward
    from taps_ray.spec import draft_compute
    from taps_ray.spec.decoder import generate
    from taps_ray.spec.protocol import SingleStrategy
    from tests.spec.spec_helpers import peaky_tiny_target, random_prompt

    monkeypatch.setattr(draft_compute, "q4q8_unsupported", lambda device, dtype: "no C compiler here")
    half = TargetModel(peaky_tiny_target(0).model, None, "peaky-fp16", weights="fp16")
    drafter = DraftHead(half.config, seed=0)
    generate(half, random_prompt(half, 8, 0), SingleStrategy(drafter, TreeConfig(depth=2, top_k=3, total_tokens=8,
                                                                               lookup_tokens=0)), max_new_tokens=6)
    assert isinstance(drafter.fc.__dict__.get("forward"), HalfLinearForward)
    x = torch.randn(1, 3, drafter.fc.in_features)
    exact = torch.nn.functional.linear(x, drafter.fc.weight, drafter.fc.bias).detach()
    with torch.inference_mode():
        fast = drafter.fc(x)
    assert 0 < float((fast - exact).abs().max()) < 1e-3
    _assert_swaps_trains_and_pickles(drafter, x, atol=2e-3)


def _assert_swaps_trains_and_pickles(drafter, x: torch.Tensor, atol: float) -> None:
    """The drafter's ``fc`` follows an in-place weight change within ``atol`` of ``F.linear``, trains through
    ``F.linear`` exactly, and a pickled copy computes as it does."""
    import pickle

    with torch.no_grad():
        drafter.fc.weight.mul_(2.0)
        again = drafter.fc(x)
    torch.testing.assert_close(again, torch.nn.functional.linear(x, drafter.fc.weight, drafter.fc.bias),
                               rtol=0, atol=atol)
    trained = drafter.fc(x)
    assert trained.requires_grad and torch.equal(trained.detach(),
                                                 torch.nn.functional.linear(x, drafter.fc.weight, drafter.fc.bias).detach())
    copy = pickle.loads(pickle.dumps(drafter))
    with torch.inference_mode():
        assert torch.equal(copy.fc(x), drafter.fc(x))


@needs_cc
@pytest.mark.parametrize("weights", ["q4q8", pytest.param("fp16", marks=needs_fbgemm)])
def test_a_drafter_of_a_low_bit_target_reads_its_linears_as_q8_codes_outside_autograd_only(weights):
    """After drafting for a q4q8 target, or an fp16 one where the q4q8 kernel runs, the drafter's linears compute
    on Q8_0 codes of their weights times int8 activations without autograd, each row as if alone, follow in-place
    weight changes (hot swap), train through F.linear as before, and pickle without the packed copy; a linear the
    kernel cannot tile keeps F.linear."""
    from taps_ray.models.drafter import DraftHead
    from taps_ray.models.quant import Q8LinearForward, Q8Q8Linear, read_linears_in_q8
    from taps_ray.spec.decoder import generate
    from taps_ray.spec.protocol import SingleStrategy
    from tests.spec.spec_helpers import peaky_tiny_target, random_prompt

    target = TargetModel(peaky_tiny_target(0).model, None, f"peaky-{weights}", weights=weights)
    drafter = DraftHead(target.config, seed=0)
    tree = TreeConfig(depth=2, top_k=3, total_tokens=8, lookup_tokens=0)
    generate(target, random_prompt(target, 8, 0), SingleStrategy(drafter, tree), max_new_tokens=6)
    forwards = [m.__dict__.get("forward") for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    assert forwards and all(isinstance(f, Q8LinearForward) for f in forwards)
    x = torch.randn(1, 5, drafter.fc.in_features)
    exact = torch.nn.functional.linear(x, drafter.fc.weight, drafter.fc.bias).detach()
    with torch.inference_mode():
        fast = drafter.fc(x)
        rows = [drafter.fc(x[:, i:i + 1]) for i in range(5)]
    assert isinstance(drafter.fc.forward._product, Q8Q8Linear)
    assert 0 < float((fast - exact).abs().max()) < 0.02 * float(exact.abs().max())
    assert all(torch.equal(row, fast[:, i:i + 1]) for i, row in enumerate(rows))
    _assert_swaps_trains_and_pickles(drafter, x, atol=0.04 * float(exact.abs().max()))
    odd = torch.nn.Linear(40, 24)
    read_linears_in_q8(odd)
    with torch.inference_mode():
        y = torch.randn(2, 40)
        assert torch.equal(odd(y), torch.nn.functional.linear(y, odd.weight, odd.bias))


def test_threads_calling_a_linear_forward_at_once_make_its_product_once():
    import threading

    from taps_ray.models.quant import LinearForward

    made: list[int] = []

    class Counted(LinearForward):
        def applies(self, x, weight):
            return True

        def make(self, weight, bias):
            made.append(1)
            threading.Event().wait(0.05)  # a build long enough for every thread to arrive
            return lambda x: torch.nn.functional.linear(x, weight, bias)

    layer = torch.nn.Linear(32, 16)
    layer.forward = Counted(layer)
    start = threading.Barrier(6)
    outputs: list[torch.Tensor] = []

    def call():
        start.wait()
        with torch.inference_mode():
            outputs.append(layer(torch.ones(1, 32)))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and len(outputs) == 6 and all(torch.equal(o, outputs[0]) for o in outputs)


def test_int4_product_hands_steps_wider_than_its_rows_to_the_dense_alternative():
    weight = _q4_1_like(96, 64)
    widths = []

    def wide(x: torch.Tensor) -> torch.Tensor:
        widths.append(x.shape[0])
        return torch.full((x.shape[0], 96), 7.0, dtype=torch.bfloat16)

    routed = Int4Linear(weight, None, torch.bfloat16, torch.zeros(1), wide, max_rows=3)
    codes_only = Int4Linear(weight, None, torch.bfloat16, torch.zeros(1))
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(routed(x[:3]), codes_only(x[:3])) and widths == []
        assert torch.equal(routed(x), torch.full((4, 96), 7.0, dtype=torch.bfloat16)) and widths == [4]
        assert torch.equal(codes_only(x), codes_only(x)) and codes_only.wide is None


@pytest.mark.skipif(int4_unsupported(torch.device("cpu"), torch.bfloat16) is not None
                    or not can_pack(torch.device("cpu"), torch.bfloat16),
                    reason="int4 with a packed bf16 copy needs a CPU with native bf16 (oneDNN)")
def test_an_int4_engine_on_its_files_codes_runs_wide_steps_on_the_packed_dense_copy():
    """Given codes (a GGUF's own) match the dense weights, so a step wider than INT4_MAX_ROWS reads the packed
    dense copy (faster there) and follows the codes' own product within bf16 rounding; round-to-nearest
    codes (no file) differ from the dense weights, so they never hand over."""
    tiny = make_tiny_int4_target(0)
    model, given = tiny.model, tiny.engine
    rounded = StaticEngine(model, [None] * len(model.model.layers), "int4")
    layer = given.layers[0]
    assert all(isinstance(p.wide, Linear) and p.max_rows == INT4_MAX_ROWS
               for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert rounded.layers[0].qkv.wide is None
    x = torch.randn(INT4_MAX_ROWS + 5, model.config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        wide = layer.gate_up(x)
        layer.gate_up.max_rows = 1 << 30
        narrow = layer.gate_up(x)
    assert not torch.equal(wide, narrow)
    torch.testing.assert_close(wide.float(), narrow.float(), rtol=0.02, atol=0.02 * float(narrow.abs().max()))
