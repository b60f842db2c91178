"""Reduced draft vocabulary: the top-V target token ids of a drafter's training rows.

The drafter then scores only those ``V`` LM-head rows (``DraftHead(draft_to_target=...)``), so the
[N, H] x [H, V] products that dominate a training and a drafting step shrink by ``V / vocab``.
Frequencies count assistant tokens (``loss_mask == 1``), the tokens a drafter proposes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def token_counts(shards: Iterable[tuple[list[str], np.ndarray | None]], vocab_size: int) -> np.ndarray:
    """Int64[vocab_size] counts of assistant tokens over feature shards.

    ``shards``: (Parquet paths of one feature set, the row ids to count or None for all). Only the
    ``row_id``, ``input_ids`` and ``loss_mask`` columns are read.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    counts = np.zeros(vocab_size, dtype=np.int64)
    for paths, row_ids in shards:
        table = pq.read_table(paths, columns=["row_id", "input_ids", "loss_mask"])
        if row_ids is not None:
            table = table.filter(pc.is_in(table["row_id"], value_set=pa.array(np.asarray(row_ids, dtype=np.int64))))
        ids = _flat(table["input_ids"]).astype(np.int64)
        mask = _flat(table["loss_mask"]).astype(bool)
        if ids.size and ids.max() >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the target vocabulary of {vocab_size}")
        counts += np.bincount(ids[mask], minlength=vocab_size)
    return counts


def _flat(column) -> np.ndarray:
    """Values of a list column, also of shards written as Ray tensor extensions (struct ``data``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chunks = []
    for chunk in column.chunks:
        if isinstance(chunk.type, pa.ExtensionType):
            chunk = chunk.storage
        if pa.types.is_struct(chunk.type):
            chunk = chunk.field("data")
        chunks.append(pc.list_flatten(chunk).to_numpy(zero_copy_only=False))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)


def draft_vocabulary(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """Long[size] ascending target ids: ``always`` (e.g. EOS ids) plus the most frequent ids.

    Ties and never-seen ids are taken in ascending id order, so the result is deterministic and
    has exactly ``size`` entries (``size <= len(counts)``).
    """
    vocab = len(counts)
    if not 1 <= size <= vocab:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab}], got {size}")
    forced = sorted({int(i) for i in always})
    if any(not 0 <= i < vocab for i in forced) or len(forced) > size:
        raise ValueError(f"ids to always include {forced} must be < {vocab} and at most {size}")
    order = np.lexsort((np.arange(vocab), -counts.astype(np.int64)))
    chosen = set(forced)
    for token in order:
        if len(chosen) == size:
            break
        chosen.add(int(token))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(counts: np.ndarray, ids: torch.Tensor) -> float:
    """Fraction of counted tokens whose id is in ``ids`` (1.0 when nothing was counted)."""
    total = int(counts.sum())
    return float(counts[ids.numpy()].sum()) / total if total else 1.0
