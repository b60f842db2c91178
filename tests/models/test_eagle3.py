"""Eagle3Head: aux layers, architecture (fc 3H -> H, 2H attention input, final norm), feature fusion and
readout, incremental forward, checkpoint round trip, architecture mismatches, averaging."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from taps_ray.models.drafter import (
    DrafterLoadError,
    DraftHead,
    average_drafters,
    drafter_class,
    is_drafter_checkpoint,
    read_drafter_meta,
)
from taps_ray.models.eagle3 import Eagle3Head, aux_layers
from tests.conftest import make_tiny_target

H = 64


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(0, layers=8)


def inputs(target, n: int = 5, seed: int = 0, width: int = 3 * H):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (1, n), generator=g)
    return target.embed_tokens(tokens).detach(), torch.randn(1, n, width, generator=g), torch.arange(n)[None]


def logits(head, target, seed: int = 0) -> torch.Tensor:
    embeds, features, positions = inputs(target, seed=seed)
    with torch.inference_mode():
        return head.logits(head(embeds, head.fuse(features), positions), target.lm_head.weight)


def test_aux_layers_are_a_low_a_middle_and_a_high_layer():
    assert aux_layers(30) == (1, 14, 26)
    assert aux_layers(32) == (1, 15, 28)
    with pytest.raises(ValueError, match="at least 5 layers, got 4"):
        aux_layers(4)


def test_architecture_and_feature_contract(target):
    head = Eagle3Head(target.config, seed=0)
    assert head.aux == (1, 3, 4) and head.feature_layers == (2, 4, 5) and head.row_layers == 4
    assert DraftHead(target.config).feature_layers == (8,) and DraftHead(target.config).row_layers == 1
    assert head.fc.weight.shape == (H, 3 * H) and head.fc.bias is None
    attn = head.midlayer.self_attn
    assert attn.q_proj.weight.shape[1] == attn.k_proj.weight.shape[1] == attn.v_proj.weight.shape[1] == 2 * H
    assert attn.o_proj.weight.shape == (H, attn.q_proj.weight.shape[0])
    names = set(head.trainable_state())
    assert {"fc.weight", "norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.post_attention_layernorm.weight", "midlayer.mlp.down_proj.weight"} <= names
    x = torch.randn(2, 3, 3 * H)
    torch.testing.assert_close(head.fuse(x), x @ head.fc.weight.T)
    h = torch.randn(2, 3, H)
    torch.testing.assert_close(head.readout(h), head.norm(h))
    torch.testing.assert_close(head.logits(h, target.lm_head.weight), (head.norm(h) @ target.lm_head.weight.T).float())
    assert drafter_class("eagle3") is Eagle3Head and drafter_class("hass") is DraftHead
    with pytest.raises(ValueError, match=r"aux layers must be 3 decoder layers in \[0, 8\)"):
        Eagle3Head(target.config, aux=(1, 2, 8))


def test_the_residual_is_the_feature_and_the_token_enters_through_attention(target):
    """With attention and MLP outputs zeroed, the output is the input feature whatever the token."""
    head = Eagle3Head(target.config, seed=1).eval()
    with torch.no_grad():
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
    embeds, _, positions = inputs(target)
    features = torch.randn(1, 5, H)
    with torch.inference_mode():
        torch.testing.assert_close(head(embeds, features, positions), features)
        torch.testing.assert_close(head(embeds * 0, features, positions), features)
    fresh = Eagle3Head(target.config, seed=1).eval()
    with torch.inference_mode():
        assert not torch.allclose(fresh(embeds, features, positions), fresh(embeds.flip(1), features, positions))


def test_forward_with_cache_equals_without(target):
    head = Eagle3Head(target.config, seed=2).eval()
    embeds, features, positions = inputs(target, n=7, width=H)
    with torch.inference_mode():
        full = head(embeds, features, positions)
        cache = head.new_cache()
        first = head(embeds[:, :4], features[:, :4], positions[:, :4], cache)
        second = head(embeds[:, 4:], features[:, 4:], positions[:, 4:], cache)
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_records_the_architecture(target, tmp_path):
    head = Eagle3Head(target.config, draft_to_target=torch.arange(2, 50), seed=3, metadata={"name": "math"})
    with torch.no_grad():
        head.norm.weight.normal_()
    path = head.save(tmp_path / "drafter", target.fingerprint, extra={"algorithm": "eagle3"})
    meta = read_drafter_meta(path)
    assert meta["architecture"] == "TapsEagle3Head" and meta["aux_layers"] == [1, 3, 4] and meta["target_layers"] == 8
    assert is_drafter_checkpoint(path)
    assert load_file(str(path / "model.safetensors"))["fc.weight"].shape == (H, 3 * H)
    for cls in (DraftHead, Eagle3Head):
        loaded = cls.load(path, target.config, target.fingerprint)
        assert type(loaded) is Eagle3Head and loaded.aux == (1, 3, 4)
        assert loaded.metadata == {"name": "math", "algorithm": "eagle3"}
        assert torch.equal(loaded.draft_to_target, head.draft_to_target)
        torch.testing.assert_close(logits(loaded, target), logits(head, target))
    resaved = loaded.save(tmp_path / "again", target.fingerprint)
    assert read_drafter_meta(resaved)["aux_layers"] == [1, 3, 4]


def test_custom_aux_layers_survive_a_round_trip(target, tmp_path):
    path = Eagle3Head(target.config, aux=(0, 2, 6)).save(tmp_path / "d", target.fingerprint)
    assert DraftHead.load(path, target.config, target.fingerprint).feature_layers == (1, 3, 7)


def test_loading_one_architecture_as_another_is_an_error(target, tmp_path):
    eagle2 = DraftHead(target.config).save(tmp_path / "eagle2", target.fingerprint)
    eagle3 = Eagle3Head(target.config).save(tmp_path / "eagle3", target.fingerprint)
    with pytest.raises(DrafterLoadError, match=r"is a TapsDraftHead checkpoint \(eagle2\); it cannot be loaded as a "
                                               r"TapsEagle3Head \(eagle3\)"):
        Eagle3Head.load(eagle2, target.config, target.fingerprint)
    deeper = make_tiny_target(0, layers=10).config
    with pytest.raises(DrafterLoadError, match="of a 8-layer target, this target has 10"):
        DraftHead.load(eagle3, deeper, target.fingerprint)


def test_averaging_needs_one_architecture(target):
    a, b = Eagle3Head(target.config, seed=1), Eagle3Head(target.config, seed=2)
    mixed = average_drafters([a, b], [0.25, 0.75])
    assert type(mixed) is Eagle3Head and mixed.feature_layers == a.feature_layers
    for key, value in mixed.trainable_state().items():
        torch.testing.assert_close(value, 0.25 * a.trainable_state()[key] + 0.75 * b.trainable_state()[key])
    with pytest.raises(ValueError, match=r"cannot average drafter 0 \(TapsEagle3Head, eagle3, target layers \[2, 4, "
                                         r"5\]\) with drafter 1 \(TapsDraftHead, eagle2, target layers \[8\]\)"):
        average_drafters([a, DraftHead(target.config)], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"target layers \[1, 3, 7\]"):
        average_drafters([a, Eagle3Head(target.config, aux=(0, 2, 6))], [0.5, 0.5])


def test_int8_storage_and_bf16_loading(target, tmp_path):
    """Release packaging: int8 rows round trip within a row's rounding, and a bf16 load keeps float32 rotary."""
    head = Eagle3Head(target.config, seed=4)
    path = head.save(tmp_path / "d", target.fingerprint, weight_storage="int8-rowwise")
    loaded = DraftHead.load(path, target.config, target.fingerprint, dtype=torch.bfloat16)
    assert type(loaded) is Eagle3Head and loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.rotary.inv_freq.dtype == torch.float32
    step = head.fc.weight.abs().amax(1, keepdim=True) / 127
    assert bool(((loaded.fc.weight.float() - head.fc.weight).abs() <= step + 1e-2 * step.max()).all())
