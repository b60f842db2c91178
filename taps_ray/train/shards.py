"""Which feature rows each training worker reads, straight from the feature cache's Parquet files.

The driver plans a variant's rows once (:func:`plan_blocks`): one :class:`FeatureBlock` per Parquet
row group that holds selected rows, the blocks in an order seeded by ``train.seed``. The blocks'
rows, in that order, are the variant's row sequence; rank ``r`` of ``world`` workers trains on the
``r``-th of ``world`` equal contiguous slices of it (``rows // world`` rows; the remainder is left
out, so every worker runs the same number of steps). A worker reads only the row groups its slice
touches (:class:`ShardRows`), so the data is read once in all, whatever the worker count; with
``cache`` the slice is read in the first epoch and replayed from memory after. The sequence is a
function of the plan alone, so a restarted worker reads the same rows in the same order.

The feature files must be readable from every worker's node (the feature cache on shared storage,
like the run folder). Nothing here starts a Ray process: a worker's data costs no more than
reading its Parquet row groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

FEATURE_COLUMNS = ["row_id", "input_ids", "loss_mask", "length", "hidden"]


@dataclass(frozen=True, eq=False)
class FeatureBlock:
    """The selected rows of one Parquet row group: ``row_ids`` Int64[n] in file order."""

    dataset: str
    path: str
    row_group: int
    row_ids: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.row_ids.size)


def plan_blocks(paths: dict[str, list[str]], rows: dict[str, np.ndarray], seed: int | None) -> list[FeatureBlock]:
    """The blocks holding ``rows[dataset]`` of the Parquet files ``paths[dataset]``: reads only the
    ``row_id`` column; blocks in a random order seeded by ``seed`` (file order when None)."""
    import pyarrow.parquet as pq

    blocks = []
    for name in sorted(rows):
        wanted = np.asarray(rows[name], dtype=np.int64)
        if wanted.size == 0:
            continue
        for path in paths[name]:
            parquet = pq.ParquetFile(path)
            for group in range(parquet.num_row_groups):
                ids = parquet.read_row_group(group, columns=["row_id"])["row_id"].to_numpy()
                kept = ids[np.isin(ids, wanted)]
                if kept.size:
                    blocks.append(FeatureBlock(name, path, group, kept.astype(np.int64)))
    if seed is not None:
        blocks = [blocks[i] for i in np.random.default_rng(seed).permutation(len(blocks))]
    return blocks


def shard_span(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank ``rank``'s slice of a ``total``-row sequence: ``total // world`` rows."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    size = total // world
    return rank * size, (rank + 1) * size


class ShardRows:
    """The rows of one worker's slice of ``blocks`` (raw Parquet rows as dicts, plus ``dataset``), in
    sequence order; with ``cache``, read once and then replayed from memory."""

    def __init__(self, blocks: list[FeatureBlock], rank: int, world: int, cache: bool):
        self.blocks, self.cache = blocks, cache
        self.start, self.stop = shard_span(sum(b.rows for b in blocks), rank, world)
        self.rows: list[dict] | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[dict]:
        if self.rows is not None:
            yield from self.rows
            return
        seen: list[dict] = []
        for row in self._read():
            if self.cache:
                seen.append(row)
            yield row
        if self.cache:
            self.rows = seen

    def _read(self) -> Iterator[dict]:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        offset = 0
        for block in self.blocks:
            first, last = max(self.start - offset, 0), min(self.stop - offset, block.rows)
            offset += block.rows
            if first >= last:
                continue
            table = pq.ParquetFile(block.path).read_row_group(block.row_group, columns=FEATURE_COLUMNS)
            table = table.filter(pc.is_in(table["row_id"], value_set=pa.array(block.row_ids)))
            for row in table.slice(first, last - first).to_pylist():
                row["dataset"] = block.dataset
                yield row
            if offset >= self.stop:
                return
