"""Capture: finished served requests kept as training rows, in the feature-cache format.

A capture folder is one feature set (:mod:`taps_ray.data.feature_sets`), so ``taps train`` reads it
with the reader it reads a prepared set with (:func:`~taps_ray.data.feature_sets.open_feature_set`).
Each row is one finished request: ``input_ids`` the prompt then the output, ``loss_mask`` 1 on the
output, ``hidden`` the target features the decode loop already computed (prefill and verification;
no extra forward pass), bf16 [T, H]. The output's last token has no computed feature (no forward pass
has consumed it), so a row with features ends before it. With ``features: false`` a row keeps every
token, ``hidden`` is null and the manifest says ``"features": false``: such a folder is opened for
training only once its features are computed (:func:`fill_features`).

Columns a training reader ignores: ``prompt_sha256`` (the row's prompt, as ``prompts.json`` lists it),
``strategy``, ``finish_reason``, ``captured_at`` (unix s) and ``labels``, the routing outcome as JSON
(``drafters``, per step: ``route`` the drafter that won, ``signals`` the drafters' confidence or entropy
when the plan routes, ``answered``, ``accepted``; ``route_decisions``, ``tau``).

Bounded: a request is kept with probability ``sample_rate``; rows are buffered per replica and written
``rows_per_shard`` at a time as one shard ``part-<first row id>.parquet`` (atomic rename), then the
oldest shards are removed until ``max_rows`` and ``max_bytes`` hold (the newest shard always stays).
Writers of one folder (several verifier replicas) take turns under an exclusive file lock; row ids
stay unique across them (the manifest's ``next_row_id``).
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from taps_ray import artifacts
from taps_ray.config_serve import CaptureConfig
from taps_ray.data.contamination import FEATURE_PROMPTS, conversation_hash, prompt_hash
from taps_ray.data.feature_sets import FORMAT_VERSION, MANIFEST
from taps_ray.runstate import atomic_write, write_json

log = logging.getLogger(__name__)

LOCK = ".capture.lock"
TRAFFIC = "traffic"  # the dataset name a capture trains under (taps adapt)
ORIGIN = "serve capture"


def capture_dir(cfg: CaptureConfig, app_name: str) -> Path:
    """The capture folder: ``cfg.dir``, else ``$TAPS_CACHE/capture/<app_name>``."""
    return Path(cfg.dir) if cfg.dir else artifacts.cache_dir() / "capture" / app_name


def request_prompt_hash(prompt, tokenizer) -> str:
    """The hash ``prompts.json`` lists for a request's prompt: its first user turn (chat), its text
    (completions), or its token ids decoded (ids; joined as text without a tokenizer)."""
    if isinstance(prompt, str):
        return prompt_hash(prompt)
    if prompt and isinstance(prompt[0], dict):
        try:
            return conversation_hash(prompt)
        except ValueError:
            return prompt_hash(json.dumps(prompt, sort_keys=True))
    ids = [int(i) for i in prompt]
    return prompt_hash(tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids)))


def step_labels(records: list) -> list[dict]:
    """Per step of a served request, from the loop's step records: ``route`` (the drafter that won; None
    unless routed), ``answered`` (the drafters whose tree arrived), ``accepted`` and ``signals`` (each
    drafter's routing signal, when the tree's meta has them)."""
    out = []
    for record in records:
        signals = record.meta.get("signals")
        out.append({"route": record.meta.get("route"), "answered": list(record.meta.get("answered", [])),
                    "accepted": record.accepted,
                    "signals": None if signals is None else [round(float(v), 6) for v in signals]})
    return out


class CaptureWriter:
    """Buffers finished requests of one replica and writes them to ``folder`` (see module docs).
    Thread-safe: the decode pool's threads call :meth:`add`. ValueError when ``folder`` holds a feature
    set that is not a capture of this target."""

    def __init__(self, cfg: CaptureConfig, folder: Path, fingerprint: dict, seed: int | None = None):
        self.cfg, self.folder, self.fingerprint = cfg, Path(folder), dict(fingerprint)
        self.hidden_size = int(fingerprint["hidden_size"])
        self.rng = random.Random(seed)
        self.rows: list[dict] = []
        self.skipped = 0
        self._lock = threading.Lock()
        if (self.folder / MANIFEST).exists():
            self._manifest()

    def sampled(self) -> bool:
        """Whether the next request is kept (probability ``sample_rate``)."""
        with self._lock:
            return self.rng.random() < self.cfg.sample_rate

    def add(self, prompt_ids: list[int], output_ids: list[int], features: torch.Tensor | None, prompt_sha256: str,
            strategy: str, finish_reason: str, labels: dict) -> None:
        """Buffer one finished request; ``features`` [>= P + len(output) - 1, H] (the decode loop's
        :func:`~taps_ray.spec.decoder.generate` ``feature_sink``, concatenated), or None to keep token
        ids only. A row without an output token it can train on is not kept (``skipped``). Writes a
        shard once ``rows_per_shard`` rows are buffered."""
        tokens = list(prompt_ids) + list(output_ids)
        keep_features = self.cfg.features and features is not None
        length = len(tokens) - 1 if keep_features else len(tokens)
        if length <= len(prompt_ids):
            with self._lock:
                self.skipped += 1
            return
        hidden = None
        if keep_features:
            block = features[:length].detach().to("cpu", torch.bfloat16).contiguous()
            if block.shape != (length, self.hidden_size):
                raise ValueError(f"capture: features {tuple(features.shape)} do not cover {length} positions of "
                                 f"hidden size {self.hidden_size}")
            hidden = block.view(torch.int16).numpy().tobytes()
        row = {"input_ids": tokens[:length], "loss_mask": [0] * len(prompt_ids) + [1] * (length - len(prompt_ids)),
               "length": length, "hidden": hidden, "prompt_sha256": prompt_sha256, "strategy": strategy,
               "finish_reason": finish_reason, "captured_at": time.time(), "labels": json.dumps(labels)}
        with self._lock:
            self.rows.append(row)
            full = len(self.rows) >= self.cfg.rows_per_shard
        if full:
            self.flush()

    def flush(self) -> Path | None:
        """Write the buffered rows as one shard and apply the budget; the shard's path (None: nothing
        buffered)."""
        with self._lock:
            rows, self.rows = self.rows, []
        if not rows:
            return None
        private_folder(self.folder)
        with self._exclusive():
            manifest = self._manifest()
            state = manifest["capture"]
            first = state["next_row_id"]
            path = self.folder / f"part-{first:012d}.parquet"
            atomic_write(path, _shard_bytes(rows, first))
            path.chmod(PRIVATE_FILE)
            state["next_row_id"] = first + len(rows)
            state["shards"][path.name] = {
                "rows": len(rows), "bytes": path.stat().st_size, "written_at": time.time(),
                "tokens": sum(r["length"] for r in rows), "loss_tokens": sum(sum(r["loss_mask"]) for r in rows),
                "features": all(r["hidden"] is not None for r in rows)}
            evicted = self._evict(state)
            self._write_manifest(manifest)
            for name in evicted:  # only once the manifest no longer names them
                (self.folder / name).unlink(missing_ok=True)
        return path

    def _exclusive(self):
        return exclusive(self.folder)

    def _manifest(self) -> dict:
        path = self.folder / MANIFEST
        if path.exists():
            manifest = json.loads(path.read_text())
            if manifest.get("origin") != ORIGIN:
                raise ValueError(f"capture: {self.folder} holds a feature set that serving did not capture")
            if {k: manifest["target"].get(k) for k in ("hidden_size", "vocab_size", "embed_hash")} != \
                    {k: self.fingerprint.get(k) for k in ("hidden_size", "vocab_size", "embed_hash")}:
                raise ValueError(f"capture: {self.folder} was captured from another target "
                                 f"({manifest['target'].get('name')!r}); give serve.capture.dir another folder")
            return manifest
        return {"capture": {"next_row_id": 0, "shards": {}, "evicted_rows": 0}}

    def _evict(self, state: dict) -> list[str]:
        """Drop the oldest shards from ``state`` while the rows, bytes or age budget is exceeded (the newest
        shard always stays); the names dropped, for the caller to unlink after the manifest is written."""
        shards, dropped = state["shards"], []
        oldest_kept = None if self.cfg.max_age_s is None else time.time() - self.cfg.max_age_s
        for name in sorted(shards)[:-1]:
            rows = sum(s["rows"] for s in shards.values())
            size = sum(s["bytes"] for s in shards.values())
            too_old = oldest_kept is not None and shards[name].get("written_at", time.time()) < oldest_kept
            if not too_old and (self.cfg.max_rows is None or rows <= self.cfg.max_rows) and \
                    (self.cfg.max_bytes is None or size <= self.cfg.max_bytes):
                break
            state["evicted_rows"] += shards.pop(name)["rows"]
            dropped.append(name)
        return dropped

    def _write_manifest(self, manifest: dict) -> None:
        import pyarrow.parquet as pq

        shards = manifest["capture"]["shards"]
        paths = [str(self.folder / name) for name in sorted(shards)]
        hashes = pq.read_table(paths, columns=["prompt_sha256"]).column("prompt_sha256").to_pylist()
        write_json(self.folder / FEATURE_PROMPTS, {"sha256": hashes}).chmod(PRIVATE_FILE)
        manifest.update({
            "dataset": self.folder.name, "origin": ORIGIN, "format": FORMAT_VERSION, "target": self.fingerprint,
            "rows": sum(s["rows"] for s in shards.values()), "tokens": sum(s["tokens"] for s in shards.values()),
            "loss_tokens": sum(s["loss_tokens"] for s in shards.values()),
            "megabytes": round(sum(s["bytes"] for s in shards.values()) / 2**20, 2), "seconds": 0.0,
            "skipped": {}, "truncated": 0, "regenerated": 0,
            "features": all(s["features"] for s in shards.values()),
        })
        write_json(self.folder / MANIFEST, manifest).chmod(PRIVATE_FILE)


PRIVATE_FILE, PRIVATE_FOLDER = 0o600, 0o700
"""Modes of capture files and folders: captured prompts and outputs are user data, readable by the server's
user only."""


def private_folder(folder: Path) -> None:
    """Create ``folder`` (and missing parents) readable by this user only, and make an existing one so."""
    folder.mkdir(parents=True, exist_ok=True, mode=PRIVATE_FOLDER)
    folder.chmod(PRIVATE_FOLDER)


@contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """The capture folder's writers' lock (an exclusive ``flock`` on its ``.capture.lock``)."""
    with open(Path(folder) / LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def snapshot(folder: str | Path, into: str | Path) -> Path:
    """A frozen copy of the capture folder ``folder`` at ``into`` (replaced if it exists): its manifest, prompt
    list and shards as they are under the writers' lock, the shards hard-linked where the filesystem allows
    (a shard is never rewritten in place: writers and :func:`fill_features` replace a file by renaming
    over it), else copied. Training on the copy is untouched by rows captured and shards evicted meanwhile,
    and its held-out split stays the one it was trained against."""
    import os
    import shutil

    folder, into = Path(folder), Path(into)
    if into.exists():
        shutil.rmtree(into)
    private_folder(into)
    with exclusive(folder):
        manifest = json.loads((folder / MANIFEST).read_text())
        for name in sorted(manifest["capture"]["shards"]):
            try:
                os.link(folder / name, into / name)
            except OSError:
                shutil.copy2(folder / name, into / name)
            (into / name).chmod(PRIVATE_FILE)
        shutil.copy2(folder / FEATURE_PROMPTS, into / FEATURE_PROMPTS)
        (into / FEATURE_PROMPTS).chmod(PRIVATE_FILE)
        write_json(into / MANIFEST, manifest).chmod(PRIVATE_FILE)
    return into


def captured_requests(folder: str | Path) -> tuple[int, int]:
    """``(captured, kept)`` of a capture folder: requests written to it since it was started (the
    manifest's ``next_row_id``) and rows it keeps now; ``(0, 0)`` before its first shard."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return 0, 0
    manifest = json.loads(path.read_text())
    if manifest.get("origin") != ORIGIN:
        raise ValueError(f"capture: {folder} holds a feature set that serving did not capture")
    return int(manifest["capture"]["next_row_id"]), int(manifest["rows"])


def _shard_bytes(rows: list[dict], first_row_id: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "row_id": pa.array(range(first_row_id, first_row_id + len(rows)), type=pa.int64()),
        "input_ids": pa.array([r["input_ids"] for r in rows], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([r["loss_mask"] for r in rows], type=pa.list_(pa.int8())),
        "length": pa.array([r["length"] for r in rows], type=pa.int32()),
        "hidden": pa.array([r["hidden"] for r in rows], type=pa.binary()),
        **{name: pa.array([r[name] for r in rows], type=kind) for name, kind in (
            ("prompt_sha256", pa.string()), ("strategy", pa.string()), ("finish_reason", pa.string()),
            ("captured_at", pa.float64()), ("labels", pa.string()))},
    })
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def fill_features(folder: Path, target) -> int:
    """Compute the features of a capture folder's token-only rows with ``target`` (one teacher-forced
    pass per row, as ``taps prepare`` computes them), rewrite their shards and mark the folder
    ``"features": true``; the rows filled."""
    folder, filled = Path(folder), 0
    writer = CaptureWriter(CaptureConfig(), folder, target.fingerprint.to_dict())
    with writer._exclusive():
        manifest = writer._manifest()
        for name, shard in sorted(manifest["capture"]["shards"].items()):
            if not shard["features"]:
                filled += _rewrite_hidden(folder / name, target, None, keep_present=True)
                shard.update(features=True, bytes=(folder / name).stat().st_size)
        writer._write_manifest(manifest)
    return filled


def with_feature_layers(folder: str | Path, into: str | Path, target, kind: str) -> Path:
    """A frozen copy of the capture folder ``folder`` at ``into`` (:func:`snapshot`) whose rows store the target
    hidden states of feature kind ``kind`` (:func:`~taps_ray.data.feature_sets.stored_layers`; ``eagle3``: the
    three EAGLE-3 layers, then the last) instead of the last one alone, each row recomputed teacher forced with
    ``target`` (serving captures the last hidden state only); its manifest lists them under ``layers``.
    ``folder`` itself is untouched (the copy's shards are written anew, never through the snapshot's links)."""
    from taps_ray.data.feature_sets import stored_layers

    layers = stored_layers(kind, target.final_layer)
    into = snapshot(folder, into)
    manifest = json.loads((into / MANIFEST).read_text())
    for name, shard in sorted(manifest["capture"]["shards"].items()):
        _rewrite_hidden(into / name, target, layers, keep_present=False)
        (into / name).chmod(PRIVATE_FILE)
        shard.update(features=True, bytes=(into / name).stat().st_size)
    shards = manifest["capture"]["shards"].values()
    manifest.update(layers=list(layers), features=True,
                    megabytes=round(sum(s["bytes"] for s in shards) / 2**20, 2))
    write_json(into / MANIFEST, manifest).chmod(PRIVATE_FILE)
    return into


def _rewrite_hidden(path: Path, target, layers: tuple[int, ...] | None, keep_present: bool) -> int:
    """Recompute the ``hidden`` column of the shard at ``path`` with ``target`` (teacher forced, one row at a time;
    ``layers``: HF ``hidden_states`` indices, None the last one), for every row or, with ``keep_present``, only
    rows without one; the shard is replaced by renaming over it. The rows computed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    blobs = table.column("hidden").to_pylist()
    computed = 0
    for i, ids in enumerate(table.column("input_ids").to_pylist()):
        if keep_present and blobs[i] is not None:
            continue
        with torch.inference_mode():
            hidden = target.hidden_states(torch.tensor([ids], device=target.device), layers=layers)[0]
        blobs[i] = hidden.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        computed += 1
    table = table.set_column(table.schema.get_field_index("hidden"), "hidden", pa.array(blobs, pa.binary()))
    sink = io.BytesIO()
    pq.write_table(table, sink)
    atomic_write(path, sink.getvalue())
    return computed
