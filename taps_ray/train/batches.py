"""A training worker's batches: its slice's rows (:mod:`taps_ray.train.shards`; the same sequence
after a restart) each epoch in a seeded order, the padded batches, the held-out rows.

Each epoch the slice is read once (or replayed from memory with ``cache_rows``) and shuffled in
windows of ``shuffle_buffer`` rows by a generator seeded with (seed, epoch, rank)
(:func:`epoch_batches`). Every worker runs
``ceil((train_rows // world) / batch_size)`` steps per epoch (:func:`steps_per_epoch`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from taps_ray.data.feature_sets import decode_row


def steps_per_epoch(train_rows: int, world: int, batch_size: int) -> int:
    """Optimizer steps per epoch of each worker (a shard holds ``train_rows // world`` rows)."""
    rows = train_rows // world
    if rows < 1:
        raise ValueError(f"{train_rows} training rows cannot feed {world} workers")
    return math.ceil(rows / batch_size)


def epoch_batches(rows: Iterable[dict], batch_size: int, buffer: int, seed: int, epoch: int, rank: int
                  ) -> Iterator[list[dict]]:
    """Batches of ``batch_size`` rows (the last may be short) in a seeded order.

    Rows are gathered in windows of ``buffer`` rows; each window (with the rows left over from the
    previous one) is permuted by a generator seeded with (seed, epoch, rank). For the same input
    sequence the batches are identical; a buffer >= the shard is a full per-epoch permutation.
    """
    rng = np.random.default_rng([seed, epoch, rank])
    pending: list[dict] = []

    def emit(final: bool) -> Iterator[list[dict]]:
        nonlocal pending
        pending = [pending[i] for i in rng.permutation(len(pending))]
        cut = len(pending) if final else len(pending) // batch_size * batch_size
        for start in range(0, cut, batch_size):
            yield pending[start:start + batch_size]
        pending = pending[cut:]

    for row in rows:
        pending.append(row)
        if len(pending) >= buffer:
            yield from emit(final=False)
    if pending:
        yield from emit(final=True)


def collate(rows: list[dict], hidden_size: int, max_tokens: int | None = None,
            hidden_dtype: torch.dtype = torch.float32, layers: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded batch from feature rows (raw Parquet rows or :func:`decode_row` output).

    Returns ``input_ids`` Long[B, T], ``hidden`` [B, T, layers * H] (``hidden_dtype``; each row's last
    ``layers`` stored hidden states, :func:`decode_row`), ``loss_mask`` Float[B, T], ``attention_mask``
    Long[B, T]; T is the longest row (after cropping rows to ``max_tokens``); padding is 0.
    """
    decoded = [r if isinstance(r.get("hidden"), torch.Tensor) else decode_row(r, hidden_size, layers) for r in rows]
    lengths = [min(len(r["input_ids"]), max_tokens or len(r["input_ids"])) for r in decoded]
    batch, longest = len(decoded), max(lengths)
    input_ids = torch.zeros(batch, longest, dtype=torch.long)
    loss_mask = torch.zeros(batch, longest, dtype=torch.float32)
    attention_mask = torch.zeros(batch, longest, dtype=torch.long)
    hidden = torch.zeros(batch, longest, layers * hidden_size, dtype=hidden_dtype)
    for i, (row, n) in enumerate(zip(decoded, lengths)):
        input_ids[i, :n] = row["input_ids"][:n]
        loss_mask[i, :n] = row["loss_mask"][:n]
        attention_mask[i, :n] = 1
        hidden[i, :n] = row["hidden"][:n].to(hidden_dtype)
    return {"input_ids": input_ids, "hidden": hidden, "loss_mask": loss_mask, "attention_mask": attention_mask}


def heldout_rows(tables: dict | None, hidden_size: int, layers: int = 1) -> dict[str, list[dict]]:
    """Decoded held-out rows per dataset from pyarrow feature tables per dataset (``layers``: :func:`decode_row`);
    a dataset whose rows store fewer than ``layers`` hidden states (an EAGLE-3 drafter's held-out metrics on a
    set prepared with the last hidden state only) is left out."""
    rows: dict[str, list[dict]] = {}
    for name, table in (tables or {}).items():
        for row in table.to_pylist():
            if len(row["hidden"]) < 2 * int(row["length"]) * hidden_size * layers:
                break
            for key in ("input_ids", "loss_mask"):
                if isinstance(row[key], dict):
                    row[key] = row[key]["data"]
            rows.setdefault(name, []).append(decode_row(row, hidden_size, layers))
    return rows
