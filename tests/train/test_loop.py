"""Training-loop pieces without Ray: batch order and resume skipping, schedule, collation, failure
hook, metrics log, draft vocabulary, train/variant configs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from taps_ray.config import ConfigError, TrainConfig, load_config
from taps_ray.runtime.faults import fail_at_step
from taps_ray.train.batches import collate, epoch_batches, steps_per_epoch
from taps_ray.train.loop import MetricsLog, noise_seed
from taps_ray.train.schedule import lr_at, plan_stages, stage_of
from taps_ray.train.vocab import coverage, draft_vocabulary, token_counts
from tests.conftest import REPO

DEMO = REPO / "configs" / "demo.yaml"


def _ids(batches):
    return [[r["row_id"] for r in b] for b in batches]


@pytest.mark.parametrize("buffer", [4, 7, 1000])
def test_epoch_order_is_seeded_complete_and_replayable(buffer):
    rows = [{"row_id": i} for i in range(23)]
    first = _ids(epoch_batches(rows, 4, buffer, seed=5, epoch=1, rank=0))
    assert first == _ids(epoch_batches(rows, 4, buffer, seed=5, epoch=1, rank=0))
    assert sorted(i for b in first for i in b) == list(range(23))
    assert [len(b) for b in first] == [4] * 5 + [3]
    assert first != _ids(epoch_batches(rows, 4, buffer, seed=5, epoch=2, rank=0))
    assert first != _ids(epoch_batches(rows, 4, buffer, seed=6, epoch=1, rank=0))
    if buffer >= 23:
        assert first != sorted(first) and sorted(i for b in first[:2] for i in b) != list(range(8))


def test_schedule_and_stages():
    assert [round(lr_at(s, 10, 1.0, 2, "cosine"), 3) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(9, 10, 1.0, 2, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert lr_at(9, 10, 1.0, 0, "linear") == pytest.approx(0.1)
    assert lr_at(9, 10, 1.0, 0, "constant") == 1.0
    train = TrainConfig(epochs=2, lr=1e-3, stage2={"epochs": 1, "lr": 1e-4, "topk_weight": 1.0})
    hass = plan_stages(train, "hass")
    assert [(s.first_epoch, s.epochs, s.lr, s.topk_weight) for s in hass] == [(0, 2, 1e-3, None), (2, 1, 1e-4, 1.0)]
    assert stage_of(hass, 2).lr == 1e-4 and stage_of(hass, 1).lr == 1e-3
    assert len(plan_stages(train, "eagle2")) == 1
    assert steps_per_epoch(25, 2, 4) == 3
    with pytest.raises(ValueError):
        steps_per_epoch(1, 2, 4)


def _raw_row(row_id, length, hidden_size=3):
    hidden = torch.arange(length * hidden_size, dtype=torch.float32).view(length, hidden_size).to(torch.bfloat16)
    return {"row_id": row_id, "input_ids": np.arange(length, dtype=np.int32) + 2,
            "loss_mask": np.r_[np.zeros(2, np.int8), np.ones(length - 2, np.int8)], "length": length,
            "hidden": hidden.view(torch.int16).numpy().tobytes()}


def test_collate_pads_right_and_crops():
    batch = collate([_raw_row(0, 5), _raw_row(1, 3)], hidden_size=3)
    assert batch["input_ids"].shape == (2, 5) and batch["hidden"].shape == (2, 5, 3)
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert batch["input_ids"][1].tolist() == [2, 3, 4, 0, 0]
    assert batch["loss_mask"][1].tolist() == [0, 0, 1, 0, 0]
    assert batch["hidden"][0, 4].tolist() == [12.0, 13.0, 14.0] and batch["hidden"][1, 3:].abs().sum() == 0
    cropped = collate([_raw_row(0, 5), _raw_row(1, 3)], hidden_size=3, max_tokens=4)
    assert cropped["input_ids"].shape == (2, 4) and cropped["attention_mask"][0].sum() == 4


def test_noise_seed_depends_on_seed_rank_and_step_only():
    seeds = {noise_seed(s, r, t) for s in (0, 1) for r in (0, 1) for t in (0, 1, 2)}
    assert len(seeds) == 12 and noise_seed(0, 1, 2) == noise_seed(0, 1, 2)
    assert torch.Generator().manual_seed(noise_seed(3, 0, 5)).initial_seed() == noise_seed(3, 0, 5)


def test_fail_at_parsing():
    assert fail_at_step("7", "a") == 7 and fail_at_step(7, "a") == 7
    assert fail_at_step("a:11,b:3", "b") == 3 and fail_at_step("a:11", "b") is None
    assert fail_at_step(None, "a") is None and fail_at_step("", "a") is None


def test_metrics_log_truncates_to_resumed_step(tmp_path):
    log = MetricsLog(tmp_path / "m" / "metrics.jsonl")
    for step in (2, 4, 6, 8):
        log.append({"step": step})
    log.truncate(5)
    log.append({"step": 6, "again": True})
    records = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6] and records[-1]["again"]
    MetricsLog(None).append({"step": 1})


def _events(path: Path) -> list:
    """Events of one TensorBoard event file (TFRecord framing: length, crc, payload, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    data, events, offset = path.read_bytes(), [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        payload = data[offset + 12: offset + 12 + length]
        events.append(event_pb2.Event.FromString(payload))
        offset += 12 + length + 4
    return events


def test_metrics_log_writes_tensorboard_scalars_and_purges_replayed_steps(tmp_path):
    log = MetricsLog(tmp_path / "v" / "metrics.jsonl")
    for step in (2, 4, 6):
        log.append({"kind": "train", "step": step, "epoch": 1, "time": 0.0, "loss": 1.0 / step, "lr": 1e-3})
    log.append({"kind": "eval", "step": 6, "heldout/math/tau": 1.5, "note": "text", "nan": float("nan")})
    log.close()
    first = sorted((tmp_path / "v" / "tensorboard").iterdir())
    scalars = [(e.step, v.tag, round(v.simple_value, 6)) for f in first for e in _events(f) for v in e.summary.value]
    assert scalars == [(2, "train/loss", 0.5), (2, "train/lr", 0.001), (4, "train/loss", 0.25), (4, "train/lr", 0.001),
                       (6, "train/loss", round(1 / 6, 6)), (6, "train/lr", 0.001), (6, "eval/heldout/math/tau", 1.5)]
    resumed = MetricsLog(tmp_path / "v" / "metrics.jsonl")
    resumed.truncate(4)
    resumed.append({"kind": "train", "step": 6, "loss": 0.1})
    resumed.close()
    events = [e for f in sorted((tmp_path / "v" / "tensorboard").iterdir()) for e in _events(f)]
    purge = [i for i, e in enumerate(events) if e.HasField("session_log") and e.step == 5]
    assert purge and events[purge[0]].session_log.status == events[purge[0]].session_log.START
    after = [(e.step, v.tag, round(v.simple_value, 6)) for e in events[purge[0]:] for v in e.summary.value]
    assert after == [(6, "train/loss", 0.1)]


def test_draft_vocabulary_from_assistant_tokens(tmp_path):
    table = pa.table({"row_id": pa.array([0, 1, 2], pa.int64()),
                      "input_ids": pa.array([[5, 6, 6, 7], [6, 8, 8, 8], [9, 9, 9, 9]], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], pa.list_(pa.int8()))})
    pq.write_table(table, tmp_path / "a.parquet")
    counts = token_counts([([str(tmp_path / "a.parquet")], np.array([0, 1]))], vocab_size=12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 3, 1, 3, 0, 0, 0]
    ids = draft_vocabulary(counts, 3, always=[1])
    assert ids.tolist() == [1, 6, 8]
    assert coverage(counts, ids) == pytest.approx(6 / 7)
    assert draft_vocabulary(counts, 5).tolist() == [0, 1, 6, 7, 8]
    with pytest.raises(ValueError):
        draft_vocabulary(counts, 13)


VARIANTS = "variants=[{name: m, algorithm: hass, mixture: math-only, objective: {topk_weight: 0}}, " \
           "{name: c, algorithm: eagle2, mixture: chat-only, train: {epochs: 5}}]"


def test_variant_configs_validate_and_merge():
    cfg = load_config(DEMO, [VARIANTS, "train.stage2={epochs: 1, lr: 1e-4}"])
    hass, eagle = cfg.variants
    assert hass.objective_config().topk_weight == 0 and hass.objective_config().passes == 3
    assert cfg.variant_train(hass).stage2.epochs == 1 and cfg.variant_train(eagle).stage2 is None
    assert cfg.variant_train(eagle).epochs == 5 and cfg.variant_train(hass).epochs == cfg.train.epochs
    with pytest.raises(ConfigError, match=r"unknown mixture 'nope'; valid mixtures: \['chat-only', 'math-only', 'mixed'\]"):
        load_config(DEMO, ["variants=[{name: x, mixture: nope}]"])
    with pytest.raises(ConfigError, match="objective: unknown key"):
        load_config(DEMO, ["variants=[{name: x, mixture: mixed, objective: {bogus: 1}}]"])
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(DEMO, ["variants=[{name: x, mixture: mixed, train: {lr: -1}}]"])
    with pytest.raises(ConfigError, match="HASS recipe"):
        load_config(DEMO, ["variants=[{name: x, mixture: mixed, train: {stage2: {epochs: 1}}}]"])
    with pytest.raises(ConfigError, match="used twice"):
        load_config(DEMO, ["variants=[{name: x, mixture: mixed}, {name: x, mixture: mixed}]"])
