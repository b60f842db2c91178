"""Bootstrap intervals over questions: how far a table's number or a claim's margin could move with other
questions of the same benchmarks.

The unit of resampling is the question (its records of every strategy and temperature move together), drawn
with replacement within each benchmark: a *paired* bootstrap, so a difference between two strategies is
measured on the same questions in every resample. Intervals are percentile intervals at :data:`LEVEL`.

- :func:`tau_interval`: one tau cell (appended / steps over a benchmark's questions), vectorised;
  :func:`mean_tau_interval`: the mean over benchmarks (the table's average column).
- :class:`QuestionResampler`: the records of one resample at a time, for statistics computed by the report's
  own table code (the claims' margins, :mod:`taps_ray.eval.claims`).
- :func:`speedup_interval`: a speed table's speedup (tokens/s against vanilla's on the same questions).
- :func:`percentile_interval`: the interval of a list of resampled values.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np

LEVEL = 0.95
TAU_RESAMPLES = 2000
CLAIM_RESAMPLES = 400
SEED = 0


def percentile_interval(values: list[float], level: float = LEVEL) -> tuple[float, float]:
    """The central ``level`` interval of ``values`` (NaNs left out; (nan, nan) when none is left)."""
    finite = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if finite.size == 0:
        return math.nan, math.nan
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(finite, [tail, 100 - tail])
    return float(low), float(high)


def _resampled_taus(records: list[dict], resamples: int, seed: int) -> np.ndarray:
    """tau of ``resamples`` draws of ``records`` with replacement: [resamples] (NaN where a draw has no steps)."""
    appended = np.asarray([r["appended"] for r in records], dtype=float)
    steps = np.asarray([r["steps"] for r in records], dtype=float)
    draws = np.random.default_rng(seed).integers(0, len(records), size=(resamples, len(records)))
    totals = steps[draws].sum(axis=1)
    return np.divide(appended[draws].sum(axis=1), totals, out=np.full(resamples, np.nan), where=totals > 0)


def tau_interval(records: list[dict], resamples: int = TAU_RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """The interval of tau = sum(appended) / sum(steps) over ``records`` (one benchmark's questions of one
    strategy), questions drawn with replacement; (nan, nan) without records."""
    if not records:
        return math.nan, math.nan
    return percentile_interval(_resampled_taus(records, resamples, seed).tolist())


def mean_tau_interval(groups: list[list[dict]], resamples: int = TAU_RESAMPLES,
                      seed: int = SEED) -> tuple[float, float]:
    """The interval of the mean over benchmarks of their tau (``groups``: each benchmark's records of one
    strategy; empty ones left out, as the table's average leaves them out), each benchmark resampled apart."""
    taus = [_resampled_taus(g, resamples, seed + i) for i, g in enumerate(groups) if g]
    if not taus:
        return math.nan, math.nan
    return percentile_interval(np.nanmean(np.stack(taus), axis=0).tolist())


def speedup_interval(groups: list[np.ndarray], resamples: int = TAU_RESAMPLES,
                     seed: int = SEED) -> tuple[float, float]:
    """The interval of a speedup, (sum tokens / sum seconds) of a strategy over the same of vanilla, with each
    benchmark's questions drawn with replacement apart. ``groups``: per benchmark, [questions, 4] rows of (the
    strategy's new tokens, its seconds, vanilla's new tokens, vanilla's seconds) on the same question; empty
    ones are left out. (nan, nan) without questions."""
    rng = np.random.default_rng(seed)
    totals = np.zeros((resamples, 4))
    for group in groups:
        if len(group):
            totals += group[rng.integers(0, len(group), size=(resamples, len(group)))].sum(axis=1)
    if not totals.any():
        return math.nan, math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (totals[:, 0] / totals[:, 1]) / (totals[:, 2] / totals[:, 3])
    return percentile_interval(ratios.tolist())


class QuestionResampler:
    """Draws paired resamples of ``records``: per benchmark, its questions with replacement, each drawn
    question bringing all its records (every strategy and temperature)."""

    def __init__(self, records: list[dict], seed: int = SEED):
        self.by_question: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for r in records:
            self.by_question[r["benchmark"]][str(r["question_id"])].append(r)
        self.questions = {b: sorted(qs) for b, qs in self.by_question.items()}
        self.rng = random.Random(seed)

    def counts(self) -> dict[str, int]:
        """Questions per benchmark."""
        return {b: len(qs) for b, qs in self.questions.items()}

    def draw(self) -> list[dict]:
        """One resample's records."""
        out = []
        for b, questions in self.questions.items():
            for q in self.rng.choices(questions, k=len(questions)):
                out += self.by_question[b][q]
        return out
