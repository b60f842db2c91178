"""The files of an evaluation folder: ``records.jsonl`` (one JSON record per benchmark, question,
strategy and temperature, appended as units finish) and ``run.json`` (what the records depend on).

Light on purpose (no torch): the report reads records without loading the runner.
"""

from __future__ import annotations

import json
from pathlib import Path

RECORDS = "records.jsonl"
RUN_FILE = "run.json"


def record_key(record: dict) -> tuple:
    """A record's identity: (benchmark, question id as text, strategy, temperature)."""
    return record["benchmark"], str(record["question_id"]), record["strategy"], float(record["temperature"])


def read_records(path: str | Path) -> list[dict]:
    """Records of ``path`` (``records.jsonl`` or its folder), first of each key; unreadable lines (an
    interrupted write) are skipped."""
    path = Path(path)
    path = path / RECORDS if path.is_dir() else path
    if not path.is_file():
        return []
    seen, out = set(), []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            key = record_key(record)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if key not in seen:
            seen.add(key)
            out.append(record)
    return out
