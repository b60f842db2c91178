"""Drafter weight storage: int8 per-row round trip, its error bound, and refusal of inconsistent files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from taps_ray.models.drafter import DrafterLoadError, DraftHead, read_drafter_meta
from taps_ray.models.weight_storage import INT8_ROWWISE, WeightStorageError, dequantize, quantize_int8_rowwise
from tests.conftest import make_tiny_target


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(0)


def test_int8_rowwise_error_is_at_most_half_a_step_per_row():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 48, generator=g) * torch.logspace(-3, 0, 32)[:, None]
    weight[3] = 0.0
    stored = quantize_int8_rowwise({"w": weight, "b": torch.ones(32), "ids": torch.arange(5)})
    assert stored["w"].dtype == torch.int8 and stored["w.scale"].shape == (32,)
    assert torch.equal(stored["b"], torch.ones(32)) and torch.equal(stored["ids"], torch.arange(5))
    restored = dequantize(stored, INT8_ROWWISE)
    step = weight.abs().amax(dim=1) / 127
    assert ((restored["w"] - weight).abs() <= step[:, None] / 2 + 1e-7).all()
    assert torch.equal(restored["w"][3], torch.zeros(48))
    assert (restored["w"].abs().amax(dim=1) - weight.abs().amax(dim=1)).abs().max() < 1e-6


def test_int8_drafter_round_trip_is_smaller_and_drafts_nearly_the_same(target, tmp_path):
    head = DraftHead(target.config, seed=3, metadata={"name": "math"})
    plain = head.save(tmp_path / "plain", target.fingerprint)
    packed = head.save(tmp_path / "int8", target.fingerprint, weight_storage=INT8_ROWWISE)
    assert read_drafter_meta(packed)["weight_storage"] == INT8_ROWWISE
    assert "weight_storage" not in read_drafter_meta(plain)
    size = {p: (p / "model.safetensors").stat().st_size for p in (plain, packed)}
    assert size[packed] < 0.3 * size[plain]
    loaded = DraftHead.load(packed, target.config, target.fingerprint)
    assert loaded.metadata == {"name": "math"}
    for key, value in head.trainable_state().items():
        error = (loaded.trainable_state()[key] - value).abs().max()
        bound = value.abs().max() / 127 / 2 + 1e-7 if value.dim() == 2 else 0.0
        assert error <= bound, key
    resaved = loaded.save(tmp_path / "resaved", target.fingerprint)
    assert "weight_storage" not in read_drafter_meta(resaved)
    assert all(t.dtype != torch.int8 for t in load_file(str(resaved / "model.safetensors")).values())


def test_inconsistent_int8_files_are_refused_by_name(target, tmp_path):
    packed = DraftHead(target.config, seed=1).save(tmp_path / "int8", target.fingerprint, weight_storage=INT8_ROWWISE)
    weights = packed / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["fc.weight.scale"]
    save_file(tensors, str(weights))
    with pytest.raises(DrafterLoadError, match=r"'fc.weight' has no matching 'fc.weight.scale'"):
        DraftHead.load(packed, target.config, target.fingerprint)
    meta = read_drafter_meta(packed)
    (packed / "config.json").write_text(json.dumps({**meta, "weight_storage": "int4"}))
    with pytest.raises(DrafterLoadError, match=r"weight_storage 'int4' is not one of plain, int8-rowwise"):
        DraftHead.load(packed, target.config, target.fingerprint)
    with pytest.raises(WeightStorageError, match="'fp4'"):
        DraftHead(target.config).save(tmp_path / "bad", target.fingerprint, weight_storage="fp4")
    assert not (tmp_path / "bad").exists()
