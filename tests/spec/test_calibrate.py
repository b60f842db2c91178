"""spec/calibrate.py: the row count from which an int4 engine's steps read the packed dense copy, measured per
machine, cached, applied before the cost model is measured, and left alone where the config pins it."""

from __future__ import annotations

import json

import pytest
import torch

from taps_ray.models.engine import Linear, can_pack
from taps_ray.models.quant import INT4_MAX_ROWS, int4_unsupported
from taps_ray.spec import calibrate, cost
from taps_ray.spec.calibrate import ROWS, best_threshold, calibrate_int4_rows, int4_rows_path
from taps_ray.spec.machine import fingerprint
from tests.conftest import make_tiny_int4_target, make_tiny_target


def test_the_threshold_minimises_the_total_and_is_not_moved_by_one_noisy_point():
    rows = (1, 2, 3, 4, 5, 6)
    assert best_threshold([1, 2, 3, 4, 5, 6], [9] * 6, rows) == 6, "codes faster everywhere: every step reads them"
    assert best_threshold([1, 2, 3, 4, 10, 11], [1, 5, 5, 5, 5, 5], rows) == 4
    assert best_threshold([1, 9, 9, 9, 9, 9], [1, 2, 2, 2, 2, 2], rows) == 1, "dense wins from 2 rows"
    noisy = [1, 2, 3, 9, 4.9, 9]  # codes lose at 4 rows, then win at 5 by less than the loss: still dense from 4
    assert best_threshold(noisy, [1, 5, 5, 5, 5, 5], rows) == 3
    assert best_threshold([1, 2, 5, 5], [1, 2, 5, 5], (1, 2, 3, 4)) == 4, "a tie keeps the codes"


needs_int4 = pytest.mark.skipif(int4_unsupported(torch.device("cpu"), torch.bfloat16) is not None
                                or not can_pack(torch.device("cpu"), torch.bfloat16),
                                reason="int4 codes with a packed bf16 copy need a CPU with native bf16 (oneDNN)")


@needs_int4
def test_an_int4_target_is_calibrated_once_cached_and_its_threshold_keys_the_cost_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    target = make_tiny_int4_target()
    engine = target.engine
    products = [p for layer in engine.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    assert all(isinstance(p.wide, Linear) for p in products) and engine.int4_max_rows == INT4_MAX_ROWS
    measured = calibrate.measure_int4_rows(target, rows=(1, 2, 4), repeats=1)
    assert measured["rows"] == [1, 2, 4] and measured["int4_max_rows"] in (1, 2, 4)
    assert measured["dense_s"][0] == measured["codes_s"][0] and all(s > 0 for s in measured["codes_s"])
    assert engine.int4_max_rows == INT4_MAX_ROWS, "measuring restores the engine's setting"

    calls = []
    monkeypatch.setattr(calibrate, "measure_int4_rows",
                        lambda t: calls.append(1) or {**measured, "int4_max_rows": 3, "measured_s": 0.1})
    assert calibrate_int4_rows(target) == 3 and all(p.max_rows == 3 for p in products)
    key = {**fingerprint(target), "int4_max_rows": "measured"}
    assert json.loads(int4_rows_path(key).read_text())["int4_max_rows"] == 3
    assert fingerprint(target)["int4_max_rows"] == 3, "the cost model is keyed by the threshold it runs with"

    again = make_tiny_int4_target()
    assert calibrate_int4_rows(again) == 3 and len(calls) == 1, "a second process reads the cached threshold"
    monkeypatch.setattr(cost, "measure", lambda t: cost.CostModel([1, 2], [0.01, 0.02], 8, fingerprint(t)))
    fresh = make_tiny_int4_target()
    assert cost.cost_model(fresh).key["int4_max_rows"] == 3 and fresh.engine.int4_rows_calibrated

    model = cost.cost_model(fresh)
    cost.cost_path(model.key).write_text(json.dumps(model.to_dict()))
    assert cost.retire_cost_model(model) and not int4_rows_path(key).exists(), "retired with its cost model"
    int4_rows_path(key).write_text('{"key": "not this one", "int4_max_rows": 0}')
    assert calibrate_int4_rows(make_tiny_int4_target()) == 3 and len(calls) == 2, "an unusable record is measured again"

    pinned = make_tiny_int4_target()
    pinned.engine.set_int4_max_rows(6)
    pinned.engine.int4_rows_pinned = True
    assert calibrate_int4_rows(pinned) is None and pinned.engine.int4_max_rows == 6, "target.int4_max_rows wins"


def test_targets_without_int4_codes_and_a_dense_copy_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "measure_int4_rows", lambda t: pytest.fail("nothing to calibrate"))
    dense = make_tiny_target(0)
    assert dense.engine is not None and dense.engine.int4_max_rows is None
    assert calibrate_int4_rows(dense) is None and fingerprint(dense)["int4_max_rows"] is None
    with pytest.raises(ValueError, match="int4_max_rows must be >= 1"):
        dense.engine.set_int4_max_rows(0)
    assert list(tmp_path.iterdir()) == []
    assert ROWS[0] == 1 and list(ROWS) == sorted(set(ROWS))


@needs_int4
@pytest.mark.slow
def test_the_config_pins_the_embedded_targets_threshold():
    from taps_ray.config import TargetConfig
    from taps_ray.models.target import TargetModel

    target = TargetModel.load(TargetConfig(dtype="bfloat16", weights="int4", int4_max_rows=6))
    assert target.engine.int4_max_rows == 6 and target.engine.int4_rows_pinned
    assert calibrate_int4_rows(target) is None and fingerprint(target)["int4_max_rows"] == 6
