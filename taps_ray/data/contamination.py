"""Contamination guard: which prompts a drafter trained on, and the GSM8K-test training pool.

A prompt is identified by :func:`prompt_hash`, the sha256 (hex) of its :func:`normalize` form:
Unicode NFKC, case-folded, every run of whitespace one space, stripped. A training conversation is
identified by its first user turn; an evaluation question by each of its turns.

Files:

- a feature set keeps ``prompts.json`` (:data:`FEATURE_PROMPTS`): ``{"sha256": [...]}`` with the
  hash of row ``i``'s first user turn at index ``i`` (``superset: true`` when it was recorded after
  the fact from every conversation of the source, a superset of the rows);
- a drafter folder keeps ``trained_prompts.json`` (:data:`TRAINED_PROMPTS`): ``{"sha256": [sorted
  hashes], "count", "sources": [...]}``, the union of the feature sets its mixture drew from (an
  averaged drafter: the union of its parts). A drafter without the file trained on nothing known.

GSM8K-test training pool (source kind ``gsm8k_test_split``): a question belongs to the *training
pool* when ``int(sha256("gsm8k-test-pool/v1:" + normalize(question))[:8], 16) % 100 <``
:data:`GSM8K_TRAIN_POOL_PERCENT` (75), else to the *reserved pool*, which no source trains on.
The rule depends on the question text alone, so it is the same for every copy of GSM8K test.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from taps_ray.runstate import write_json

TRAINED_PROMPTS = "trained_prompts.json"
FEATURE_PROMPTS = "prompts.json"
NORMALIZATION = "nfkc-casefold-whitespace/v1"
GSM8K_TRAIN_POOL_PERCENT = 75
_POOL_SALT = "gsm8k-test-pool/v1:"
_WHITESPACE = re.compile(r"\s+")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ContaminationError(ValueError):
    """A prompts file is unreadable or malformed; the message names the file."""


def normalize(text: str) -> str:
    """The form prompts are compared in: NFKC, case-folded, whitespace runs -> one space, stripped."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def prompt_hash(text: str) -> str:
    """sha256 hex digest of ``normalize(text)``."""
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()


def conversation_hash(conversation: list[dict]) -> str:
    """:func:`prompt_hash` of the first user turn; ValueError if there is none."""
    for turn in conversation:
        if turn.get("role") == "user":
            return prompt_hash(turn["content"])
    raise ValueError(f"conversation has no user turn (roles: {[t.get('role') for t in conversation]})")


def question_hashes(turns: Iterable[str]) -> set[str]:
    """Hashes of every turn of an evaluation question."""
    return {prompt_hash(turn) for turn in turns}


def in_gsm8k_training_pool(question: str) -> bool:
    """True when the GSM8K-test ``question`` is in the training pool (see module docstring)."""
    digest = hashlib.sha256((_POOL_SALT + normalize(question)).encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < GSM8K_TRAIN_POOL_PERCENT


def _read_hashes(path: Path) -> list[str]:
    try:
        payload = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ContaminationError(f"{path}: unreadable prompts file: {err}") from None
    hashes = payload.get("sha256") if isinstance(payload, dict) else None
    if not isinstance(hashes, list) or not all(isinstance(h, str) and _HEX64.match(h) for h in hashes):
        raise ContaminationError(f"{path}: 'sha256' must be a list of 64-character lowercase hex digests")
    return hashes


def write_feature_prompts(folder: str | Path, hashes: list[str], superset: bool = False) -> Path:
    """Write a feature set's ``prompts.json`` (``hashes[i]`` belongs to row ``i``)."""
    path = Path(folder) / FEATURE_PROMPTS
    write_json(path, {"normalization": NORMALIZATION, "superset": superset, "count": len(hashes),
                       "sha256": list(hashes)}, indent=0)
    return path


def read_feature_prompts(folder: str | Path) -> list[str] | None:
    """The row hashes of a feature set, or None when it has no ``prompts.json`` (prepared before it existed)."""
    path = Path(folder) / FEATURE_PROMPTS
    return _read_hashes(path) if path.is_file() else None


def trained_prompts_record(hashes: Iterable[str], sources: Iterable[str]) -> dict:
    """The content of a ``trained_prompts.json``: sorted unique ``hashes`` and where they came from."""
    unique = sorted(set(hashes))
    return {"normalization": NORMALIZATION, "count": len(unique), "sources": sorted(set(sources)), "sha256": unique}


def write_trained_prompts(drafter_dir: str | Path, record: dict) -> Path:
    """Write ``record`` (from :func:`trained_prompts_record`) as the drafter's ``trained_prompts.json``."""
    path = Path(drafter_dir) / TRAINED_PROMPTS
    write_json(path, record, indent=0)
    return path


def read_trained_prompts(drafter_dir: str | Path) -> set[str]:
    """Hashes a drafter trained on; empty when the folder has no ``trained_prompts.json``."""
    path = Path(drafter_dir) / TRAINED_PROMPTS
    return set(_read_hashes(path)) if path.is_file() else set()


def union_trained_prompts(drafter_dirs: Iterable[str | Path]) -> set[str]:
    """Union of :func:`read_trained_prompts` over ``drafter_dirs``."""
    out: set[str] = set()
    for directory in drafter_dirs:
        out |= read_trained_prompts(directory)
    return out


def write_averaged(out_dir: str | Path, parts: Iterable[str | Path]) -> Path | None:
    """Give an averaged drafter in ``out_dir`` the union of its ``parts``' trained prompts (nothing
    written when no part has any); returns the file written."""
    parts = [Path(p) for p in parts]
    hashes = union_trained_prompts(parts)
    if not hashes:
        return None
    return write_trained_prompts(out_dir, trained_prompts_record(hashes, [str(p.resolve()) for p in parts]))
