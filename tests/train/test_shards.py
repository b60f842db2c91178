"""Workers' slices of the training rows, read straight from Parquet row groups."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from taps_ray.train.shards import ShardRows, plan_blocks, shard_span


def _write(path, ids: list[int], row_group_size: int) -> str:
    """A feature-format file whose rows carry their id in every column."""
    table = pa.table({"row_id": pa.array(ids, pa.int64()), "input_ids": [[i] for i in ids],
                      "loss_mask": [[1] for _ in ids], "length": pa.array([1] * len(ids), pa.int32()),
                      "hidden": [str(i).encode() for i in ids]})
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


@pytest.fixture
def files(tmp_path):
    """Dataset ``math`` (ids 0-29, two files of row groups of 4) and ``chat`` (ids 100-111, one file)."""
    return {"math": [_write(tmp_path / "m0.parquet", list(range(15)), 4),
                     _write(tmp_path / "m1.parquet", list(range(15, 30)), 4)],
            "chat": [_write(tmp_path / "c0.parquet", list(range(100, 112)), 5)]}


def _layout(blocks) -> tuple:
    return tuple((b.dataset, b.path, b.row_group, tuple(b.row_ids)) for b in blocks)


def _ids(rows) -> list[int]:
    return [r["row_id"] for r in rows]


def test_blocks_hold_exactly_the_selected_rows_in_a_seeded_order(files):
    selected = {"math": np.array([29, 0, 5, 6, 7, 17, 22]), "chat": np.array([103, 111]), "code": np.array([], int)}
    blocks = plan_blocks(files, selected, seed=3)
    assert sorted(i for b in blocks for i in b.row_ids) == sorted([0, 5, 6, 7, 17, 22, 29, 103, 111])
    assert all(list(b.row_ids) == sorted(b.row_ids) for b in blocks)
    assert {(b.dataset, b.row_group) for b in blocks if b.dataset == "chat"} == {("chat", 0), ("chat", 2)}
    assert _layout(blocks) == _layout(plan_blocks(files, selected, seed=3))
    assert len({_layout(plan_blocks(files, selected, seed=s)) for s in range(6)}) > 1
    unseeded = plan_blocks(files, selected, seed=None)
    assert _layout(unseeded) == tuple(sorted(_layout(unseeded)))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_worker_slices_partition_the_sequence_into_equal_contiguous_parts(files, world):
    selected = {"math": np.arange(0, 30, 2), "chat": np.arange(100, 112)}
    blocks = plan_blocks(files, selected, seed=7)
    sequence = [int(i) for b in blocks for i in b.row_ids]
    assert len(sequence) == 27
    size = 27 // world
    slices = [_ids(ShardRows(blocks, rank, world, cache=False)) for rank in range(world)]
    assert slices == [sequence[r * size:(r + 1) * size] for r in range(world)]
    rows = list(ShardRows(blocks, world - 1, world, cache=False))
    assert all(r["hidden"] == str(r["row_id"]).encode() and r["input_ids"] == [r["row_id"]] for r in rows)
    assert all(r["dataset"] == ("chat" if r["row_id"] >= 100 else "math") for r in rows)


def test_a_worker_reads_only_the_row_groups_its_slice_touches(files, monkeypatch):
    blocks = plan_blocks(files, {"math": np.arange(30)}, seed=None)
    read = []
    original = pq.ParquetFile.read_row_group

    def spy(self, group, *args, **kwargs):
        read.append(group)
        return original(self, group, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    assert _ids(ShardRows(blocks, 0, 3, cache=False)) == list(range(10))
    assert read == [0, 1, 2]


def test_cached_rows_are_read_once_and_replayed(files, monkeypatch):
    blocks = plan_blocks(files, {"chat": np.arange(100, 112)}, seed=1)
    cached, streamed = ShardRows(blocks, 1, 2, cache=True), ShardRows(blocks, 1, 2, cache=False)
    calls = []
    original = ShardRows._read
    monkeypatch.setattr(ShardRows, "_read", lambda self: calls.append(self) or original(self))
    assert list(cached) == list(cached) == list(streamed) == list(streamed)
    assert len(list(cached)) == len(cached) == 6
    assert calls.count(cached) == 1 and calls.count(streamed) == 2


def test_shard_span_refuses_a_rank_outside_the_world():
    assert shard_span(10, 2, 3) == (6, 9)
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, 3\)"):
        shard_span(10, 3, 3)
