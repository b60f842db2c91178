"""DraftHead: checkpoint round trip, target fingerprint checks, load errors, seeded init, reduced vocab,
weight averaging."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from taps_ray.models.drafter import DrafterLoadError, DraftHead, average_drafters, read_drafter_meta
from tests.conftest import make_tiny_target


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(0)


def inputs(target, n: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (1, n), generator=g)
    features = torch.randn(1, n, target.hidden_size, generator=g)
    return target.embed_tokens(tokens).detach(), features, torch.arange(n)[None]


def outputs(head, target, seed: int = 0) -> torch.Tensor:
    with torch.inference_mode():
        return head.logits(head(*inputs(target, seed=seed)), target.lm_head.weight)


def test_save_load_round_trip(target, tmp_path):
    head = DraftHead(target.config, seed=3, metadata={"name": "math", "algorithm": "hass"})
    with torch.no_grad():
        head.fc.bias.normal_()
    path = head.save(tmp_path / "drafter", target.fingerprint, extra={"data": "gsm8k"})
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "drafter.partial").exists()
    meta = read_drafter_meta(path)
    assert meta["target"]["embed_hash"] == target.fingerprint.embed_hash and meta["data"] == "gsm8k"
    loaded = DraftHead.load(path, target.config, target.fingerprint)
    assert loaded.metadata == {"name": "math", "algorithm": "hass", "data": "gsm8k"}
    for key, value in head.trainable_state().items():
        torch.testing.assert_close(loaded.trainable_state()[key], value, rtol=0, atol=0)
    torch.testing.assert_close(outputs(loaded, target), outputs(head, target))


def test_forward_with_cache_equals_without(target):
    """Two chunks through the cache give the same features as one causal pass."""
    head = DraftHead(target.config, seed=1).eval()
    embeds, features, positions = inputs(target, n=7)
    with torch.inference_mode():
        full = head(embeds, features, positions)
        cache = head.new_cache()
        first = head(embeds[:, :4], features[:, :4], positions[:, :4], cache)
        second = head(embeds[:, 4:], features[:, 4:], positions[:, 4:], cache)
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("other_kwargs, field", [
    ({"seed": 1}, "embed_hash"),
    ({"vocab_size": 128}, "vocab_size"),
    ({"hidden_size": 32}, "hidden_size"),
])
def test_load_against_another_target_names_the_field(target, tmp_path, other_kwargs, field):
    path = DraftHead(target.config).save(tmp_path / "drafter", target.fingerprint)
    other = make_tiny_target(**other_kwargs)
    with pytest.raises(DrafterLoadError, match=f"trained for another target: target fingerprint field '{field}'"):
        DraftHead.load(path, other.config, other.fingerprint)


def test_missing_and_corrupt_checkpoints(target, tmp_path):
    with pytest.raises(DrafterLoadError, match="does not exist"):
        DraftHead.load(tmp_path / "nowhere", target.config, target.fingerprint)
    path = DraftHead(target.config).save(tmp_path / "drafter", target.fingerprint)
    weights = (path / "model.safetensors").read_bytes()

    (path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(DrafterLoadError, match="unreadable model.safetensors"):
        DraftHead.load(path, target.config, target.fingerprint)

    (path / "model.safetensors").write_bytes(weights)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architecture": "SomethingElse"}))
    with pytest.raises(DrafterLoadError, match="architecture 'SomethingElse'"):
        DraftHead.load(path, target.config, target.fingerprint)

    (path / "config.json").write_text("{not json")
    with pytest.raises(DrafterLoadError, match="unreadable config.json"):
        DraftHead.load(path, target.config, target.fingerprint)

    (path / "config.json").unlink()
    with pytest.raises(DrafterLoadError, match="unreadable config.json"):
        DraftHead.load(path, target.config, target.fingerprint)


def test_init_is_deterministic_in_the_seed_and_leaves_global_rng_alone(target):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = DraftHead(target.config, seed=7), DraftHead(target.config, seed=7), DraftHead(target.config, seed=8)
    assert torch.equal(torch.rand(3), expected_next), "init must not consume the global RNG"
    for key, value in a.trainable_state().items():
        assert torch.equal(value, b.trainable_state()[key])
    assert not torch.equal(a.fc.weight, c.fc.weight)
    assert isinstance(a.layer.input_layernorm, torch.nn.Identity)


def test_reduced_vocabulary(target, tmp_path):
    d2t = torch.tensor([5, 9, 17, 40, 41, 200])
    head = DraftHead(target.config, draft_to_target=d2t, seed=2)
    assert head.draft_vocab_size == 6
    hidden = head(*inputs(target))
    logits = head.logits(hidden, target.lm_head.weight)
    assert logits.shape == (1, 5, 6)
    full = DraftHead.logits(DraftHead(target.config, seed=2), hidden, target.lm_head.weight)
    torch.testing.assert_close(logits, full[..., d2t])
    assert head.to_target_ids(torch.tensor([0, 5, 3])).tolist() == [5, 200, 40]
    path = head.save(tmp_path / "reduced", target.fingerprint)
    loaded = DraftHead.load(path, target.config, target.fingerprint)
    assert torch.equal(loaded.draft_to_target, d2t)
    torch.testing.assert_close(outputs(loaded, target), outputs(head, target))


def test_average_drafters(target):
    a, b = DraftHead(target.config, seed=1), DraftHead(target.config, seed=2)
    mixed = average_drafters([a, b], [0.25, 0.75])
    for key, value in mixed.trainable_state().items():
        torch.testing.assert_close(value, 0.25 * a.trainable_state()[key] + 0.75 * b.trainable_state()[key])
    same = average_drafters([a, b], [1.0, 0.0])
    torch.testing.assert_close(same.fc.weight, a.fc.weight)
    with pytest.raises(ValueError, match="sum to 1"):
        average_drafters([a, b], [0.5, 0.6])
    with pytest.raises(ValueError, match="one weight per drafter"):
        average_drafters([a, b], [1.0])
    small = DraftHead(make_tiny_target(0, hidden_size=32).config)
    with pytest.raises(ValueError, match="different architecture"):
        average_drafters([a, small], [0.5, 0.5])
    reduced = DraftHead(target.config, draft_to_target=torch.arange(10))
    with pytest.raises(ValueError, match="different draft vocabularies"):
        average_drafters([a, reduced], [0.5, 0.5])


def test_rotary_frequencies_stay_float32_in_bf16():
    from tests.conftest import tiny_llama_config

    head = DraftHead(tiny_llama_config()).to(dtype=torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16
    assert head.rotary.inv_freq.dtype == torch.float32
    fresh = DraftHead(tiny_llama_config())
    torch.testing.assert_close(head.rotary.inv_freq, fresh.rotary.inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("d2t, message", [
    ([5, 9, 5, 40], r"repeats target id 5 \(draft ids 0 and 2\)"),
    ([5, 9, 256, 40], r"draft_to_target\[2\] = 256 is outside the target vocabulary \[0, 256\)"),
    ([5, -1, 40], r"draft_to_target\[1\] = -1 is outside the target vocabulary \[0, 256\)"),
    ([5.0, 9.0], "integer target ids, got dtype torch.float32"),
    ([[5, 9]], r"1-D with at least one target id, got shape \[1, 2\]"),
])
def test_bad_draft_vocabulary_is_refused(target, tmp_path, d2t, message):
    bad = torch.tensor(d2t)
    with pytest.raises(ValueError, match=message):
        DraftHead(target.config, draft_to_target=bad)
    path = DraftHead(target.config, draft_to_target=torch.tensor([5, 9, 17, 40]), seed=2).save(
        tmp_path / "reduced", target.fingerprint)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["draft_to_target"] = bad
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(DrafterLoadError, match=f"{path.name}.*bad draft vocabulary in model.safetensors: .*{message}"):
        DraftHead.load(path, target.config, target.fingerprint)
