"""Response store for self-distillation: the target's answer to each prompt, kept across runs.

Regenerating responses is the slowest part of ``taps prepare`` on a CPU (batched greedy decoding
of every prompt), so each response is appended to a store as soon as its batch is done. A rerun
after an interruption, or a larger ``limit`` of the same seeded source (which selects a superset,
see :func:`taps_ray.data.sources.seeded_subset`), decodes only the prompts the store lacks.

A store is one JSON-lines file ``$TAPS_CACHE/regenerations/<key>.jsonl``; each line is
``{"prompt": <sha256 of the prompt turns>, "response": <text>}``. The key covers what decides the
response: the target fingerprint, the dtype it decodes in, and the regeneration settings except
``batch_size`` (a throughput knob). A torn last line (a killed writer) is ignored on read and cut
off before the next append (:mod:`taps_ray.runstate`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from taps_ray import artifacts
from taps_ray.config import RegenerationConfig
from taps_ray.runstate import append_jsonl, read_jsonl

log = logging.getLogger(__name__)

STORE_FORMAT = 2


def regenerations_root() -> Path:
    return artifacts.cache_dir() / "regenerations"


def prompt_key(prompt: list[dict]) -> str:
    """sha256 hex of the prompt turns exactly as the target sees them (roles and contents, in order)."""
    turns = [[turn["role"], turn["content"]] for turn in prompt]
    return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode("utf-8")).hexdigest()


def store_key(fingerprint: dict, dtype: str, regeneration: RegenerationConfig) -> str:
    """Key of the store for this target (sizes + embedding hash), decode dtype and settings."""
    payload = {
        "format": STORE_FORMAT,
        "target": {k: fingerprint[k] for k in ("hidden_size", "vocab_size", "embed_hash")},
        "dtype": dtype,
        "regeneration": regeneration.model_dump(exclude={"batch_size", "drafter"}),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class ResponseStore:
    """Append-only map prompt key -> response text, backed by one JSON-lines file."""

    def __init__(self, path: Path):
        self.path = path
        self.responses: dict[str, str] = {}
        for entry in read_jsonl(path, skip_damaged=True):
            self.responses[entry["prompt"]] = entry["response"]

    @classmethod
    def open(cls, fingerprint: dict, dtype: str, regeneration: RegenerationConfig) -> ResponseStore:
        """The store under ``$TAPS_CACHE/regenerations/`` for this target, dtype and settings."""
        root = regenerations_root()
        root.mkdir(parents=True, exist_ok=True)
        return cls(root / f"{store_key(fingerprint, dtype, regeneration)}.jsonl")

    def __len__(self) -> int:
        return len(self.responses)

    def get(self, key: str) -> str | None:
        return self.responses.get(key)

    def add(self, entries: list[tuple[str, str]]) -> None:
        """Record ``(prompt key, response)`` pairs; written and flushed before returning."""
        if not entries:
            return
        append_jsonl(self.path, [{"prompt": key, "response": response} for key, response in entries])
        self.responses.update(entries)
