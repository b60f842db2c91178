"""Cached feature sets: their on-disk format, content key, and reading them back.

A feature set is a folder ``$TAPS_CACHE/features/<dataset>-<key>/`` of Parquet shards with one
row per conversation: ``row_id`` int64, ``input_ids`` list<int32> [T], ``loss_mask`` list<int8>
[T] (1 on assistant tokens), ``length`` int32, ``hidden`` binary (bf16 [T, H], row-major). The
folder is complete only when ``_SUCCESS.json`` exists; it is written last, after an atomic
rename, so an interrupted ``prepare`` is never read as complete. ``prompts.json`` beside the shards
holds the hash of each row's first user turn (:mod:`taps_ray.data.contamination`). A set is opened
only for the target it was computed for. :mod:`taps_ray.data.features` writes them; a serving
capture (:mod:`taps_ray.data.capture`) writes the same format with label columns readers leave
out, and one that keeps token ids only (manifest ``"features": false``) is not opened. A dataset
whose source is ``{kind: features, path: DIR}`` is the feature set at DIR, read as it is (no key).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from taps_ray import artifacts
from taps_ray.config import DatasetConfig, ExperimentConfig, RegenerationConfig
from taps_ray.data.contamination import read_feature_prompts
from taps_ray.data.sources import reads_data_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "_SUCCESS.json"


class FeatureCacheError(RuntimeError):
    """A feature set is missing, incomplete, or was computed for another target."""


LAST, EAGLE3 = "last", "eagle3"
SELECT_BATCH_ROWS = 16
"""Rows per batch when :meth:`FeatureSet.read_table` streams a selection out of the shards."""


def feature_kind(cfg: ExperimentConfig, name: str) -> str:
    """Which target hidden states dataset ``name``'s feature set stores: ``eagle3`` (the three EAGLE-3 layers,
    then the last) when ``data.features.layers`` says so, or when it is ``auto`` and a variant of
    ``algorithm: eagle3`` trains on a mixture that reads the dataset; else ``last`` (the last hidden state)."""
    chosen = cfg.data.features.layers
    if chosen != "auto":
        return chosen
    for variant in cfg.variants:
        mixture = cfg.mixtures.get(variant.mixture)
        if variant.algorithm == EAGLE3 and mixture is not None and name in (mixture.ratio or mixture.counts or {}):
            return EAGLE3
    return LAST


def stored_layers(kind: str, layers: int) -> tuple[int, ...]:
    """The HF ``hidden_states`` indices a feature set of ``kind`` stores for a target of ``layers`` layers, in
    row order: the last hidden state (index ``layers``) always comes last, so its H columns end every row."""
    if kind == LAST:
        return (layers,)
    if kind == EAGLE3:
        from taps_ray.models.eagle3 import aux_layers

        return tuple(i + 1 for i in aux_layers(layers)) + (layers,)
    raise ValueError(f"feature layers {kind!r} is not one of {LAST}, {EAGLE3}")


def feature_key(fingerprint: dict, dataset: DatasetConfig, max_len: int, regeneration: RegenerationConfig,
                kind: str = LAST) -> str:
    """Content key of a feature set: target identity, source spec, max_len, regeneration settings, and the
    stored hidden states when not the last one alone (:func:`feature_kind`; sets of the last one keep their key).

    ``regeneration.batch_size`` and ``regeneration.drafter`` only set throughput (the answers are the target's
    whichever drafter speeds them up), so they are keyed as their default values: changing them reuses the
    feature set, as it reuses the response store (and keys of sets prepared before this rule stay the same).
    ``$TAPS_DATA_DIR`` is keyed only for datasets with an alternative that reads it (:func:`reads_data_dir`): a
    ShareGPT set is the same set whether or not the variable is set."""
    default = RegenerationConfig()
    keyed_regeneration = regeneration.model_copy(update={"batch_size": default.batch_size, "drafter": default.drafter})
    payload = {
        "format": FORMAT_VERSION,
        "target": {k: fingerprint[k] for k in ("hidden_size", "vocab_size", "embed_hash")},
        "dataset": dataset.model_dump(),
        "data_dir": os.environ.get("TAPS_DATA_DIR", "") if any(map(reads_data_dir, dataset.alternatives)) else "",
        "max_len": max_len,
        "regeneration": keyed_regeneration.model_dump(),
        **({} if kind == LAST else {"layers": kind}),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def features_root() -> Path:
    return artifacts.cache_dir() / "features"


@dataclass
class FeatureSet:
    """A complete, cached feature set (see module docstring for the row schema)."""

    name: str
    path: Path
    manifest: dict

    @property
    def rows(self) -> int:
        return int(self.manifest["rows"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["target"]["hidden_size"])

    @property
    def layers(self) -> list[int]:
        """The target hidden states each row stores (HF ``hidden_states`` indices; [] when not recorded: the
        last one alone)."""
        return list(self.manifest.get("layers", []))

    def prompt_hashes(self) -> list[str] | None:
        """Hashes of the rows' first user turns (``prompts.json``), or None when not recorded."""
        return read_feature_prompts(self.path)

    def shard_paths(self) -> list[str]:
        return sorted(str(p) for p in self.path.glob("*.parquet"))

    def read_table(self, row_ids: np.ndarray | list[int] | None = None, columns: list[str] | None = None):
        """The rows as one pyarrow Table: all of them in shard order, or those with ``row_id`` in ``row_ids``
        sorted by ``row_id`` (shards are written by parallel actors, so their order is not the rows' order).

        A selection is streamed in batches of ``SELECT_BATCH_ROWS`` rows, so memory holds the rows kept and one
        batch, never the whole set (an EAGLE-3 set of the release recipe is 2 GB)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        if row_ids is None:
            return pq.read_table(self.shard_paths(), columns=columns)
        wanted = pa.array(np.asarray(row_ids, dtype=np.int64))
        kept = []
        for path in self.shard_paths():
            shard = pq.ParquetFile(path)
            for batch in shard.iter_batches(batch_size=SELECT_BATCH_ROWS, columns=columns):
                chosen = batch.filter(pc.is_in(batch["row_id"], value_set=wanted))
                if chosen.num_rows:
                    kept.append(chosen)
        schema = pq.read_schema(self.shard_paths()[0])
        table = pa.Table.from_batches(kept, schema=pa.schema([schema.field(c) for c in columns]) if columns else schema)
        table = table.sort_by("row_id")
        pa.default_memory_pool().release_unused()
        return table

    def read_rows(self, row_ids: np.ndarray | list[int] | None = None) -> list[dict]:
        """Decode rows (all, or those with ``row_id`` in ``row_ids``) into tensors:
        ``input_ids`` Long[T], ``loss_mask`` Float[T], ``hidden`` BFloat16[T, H] (the last hidden state)."""
        return [decode_row(r, self.hidden_size) for r in self.read_table(row_ids).to_pylist()]


def decode_row(row: dict, hidden_size: int, layers: int = 1) -> dict:
    """A Parquet row as tensors; ``hidden`` BFloat16[T, layers * H]: the row's last ``layers`` stored hidden
    states (``layers`` 1: the last hidden state; 4: an EAGLE-3 set's three layers and the last). ValueError when
    the row stores fewer."""
    length = int(row["length"])
    hidden = torch.frombuffer(bytearray(row["hidden"]), dtype=torch.bfloat16).view(length, -1)
    stored = hidden.shape[1] // hidden_size
    if stored < layers or hidden.shape[1] % hidden_size:
        raise ValueError(f"feature row {row.get('row_id')} stores {stored} hidden state(s) of size {hidden_size}, "
                         f"{layers} needed: an eagle3 drafter needs features prepared with the EAGLE-3 layers "
                         f"(data.features.layers: eagle3, or auto with an eagle3 variant reading the dataset)")
    hidden = hidden[:, hidden.shape[1] - layers * hidden_size:]
    return {
        "row_id": int(row["row_id"]),
        "input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
        "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.float32),
        "hidden": hidden,
    }


def open_feature_set(path: Path, fingerprint: dict, name: str) -> FeatureSet:
    """Open a complete feature set, rejecting an incomplete one or one of another target."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise FeatureCacheError(f"features for {name!r} at {path} are missing or incomplete; run `taps prepare`")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("features") is False:
        raise FeatureCacheError(f"features for {name!r} at {path} keep token ids only (a serving capture with "
                                f"serve.capture.features false); compute them with taps_ray.data.capture.fill_features")
    for key in ("hidden_size", "vocab_size", "embed_hash"):
        if manifest["target"].get(key) != fingerprint.get(key):
            raise FeatureCacheError(
                f"features at {path} were computed for target {manifest['target'].get('name')!r}: "
                f"{key} {manifest['target'].get(key)!r} != {fingerprint.get(key)!r} of {fingerprint.get('name')!r}"
            )
    return FeatureSet(name=name, path=path, manifest=manifest)


def feature_set_path(cfg: ExperimentConfig, name: str, fingerprint: dict) -> Path:
    if name not in cfg.data.datasets:
        raise ValueError(f"unknown dataset {name!r}; datasets in config: {sorted(cfg.data.datasets)}")
    ds = cfg.data.datasets[name]
    if ds.feature_folder is not None:
        return Path(ds.feature_folder).expanduser()
    key = feature_key(fingerprint, ds, cfg.data.features.max_len, cfg.data.features.regeneration,
                      feature_kind(cfg, name))
    return features_root() / f"{name}-{key}"


def load_feature_set(cfg: ExperimentConfig, name: str, fingerprint: dict) -> FeatureSet:
    return open_feature_set(feature_set_path(cfg, name, fingerprint), fingerprint, name)


def load_feature_sets(cfg: ExperimentConfig, fingerprint: dict, required: set[str]) -> dict[str, FeatureSet]:
    """Prepared feature sets: every ``required`` dataset (:class:`FeatureCacheError` naming the first
    that is not prepared), plus any other prepared one (for held-out metrics)."""
    sets = {}
    for name in cfg.data.datasets:
        try:
            sets[name] = load_feature_set(cfg, name, fingerprint)
        except FeatureCacheError as err:
            if name in required:
                raise FeatureCacheError(f"dataset {name!r}: {err}") from None
            log.info("dataset %s has no prepared features: left out of held-out metrics", name)
    return sets
