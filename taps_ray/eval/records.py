"""The files of an evaluation folder: ``records.jsonl`` (one JSON record per benchmark, question,
strategy and temperature, appended as units finish) and ``run.json`` (what the records depend on).

Light on purpose (no torch): the report reads records without loading the runner.
"""

from __future__ import annotations

from pathlib import Path

from taps_ray.runstate import read_jsonl

RECORDS = "records.jsonl"
RUN_FILE = "run.json"


def record_key(record: dict) -> tuple:
    """A record's identity: (benchmark, question id as text, strategy, temperature, method)."""
    return (record["benchmark"], str(record["question_id"]), record["strategy"], float(record["temperature"]),
            record_method(record))


def record_method(record: dict) -> str:
    """How the record was decoded: ``paper`` (fixed tree, no lookup; also older records) or ``production``."""
    return record.get("method", "paper")


def read_records(path: str | Path) -> list[dict]:
    """Records of ``path`` (``records.jsonl`` or its folder), first of each key; a torn last line (an
    interrupted write) is skipped with a warning (:func:`taps_ray.runstate.read_jsonl`), as are
    lines that are not records."""
    path = Path(path)
    path = path / RECORDS if path.is_dir() else path
    seen, out = set(), []
    for record in read_jsonl(path):
        try:
            key = record_key(record)
        except (KeyError, TypeError, ValueError):
            continue
        if key not in seen:
            seen.add(key)
            out.append(record)
    return out
