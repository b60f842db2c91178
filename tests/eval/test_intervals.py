"""Bootstrap intervals over questions: tau cells, benchmark means, and paired resamples."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from taps_ray.eval.intervals import (
    QuestionResampler,
    mean_tau_interval,
    percentile_interval,
    speedup_interval,
    tau_interval,
)


def rec(qid, appended, steps, strategy="single:math", bench="gsm8k"):
    return {"benchmark": bench, "question_id": qid, "strategy": strategy, "appended": appended, "steps": steps}


def test_percentile_interval_leaves_out_nans():
    low, high = percentile_interval([math.nan, *range(101)])
    assert (low, high) == pytest.approx((2.5, 97.5))
    assert all(math.isnan(v) for v in percentile_interval([math.nan]))


def test_tau_interval_covers_the_tau_and_narrows_with_questions():
    same = [rec(q, 30, 10) for q in range(5)]
    assert tau_interval(same) == pytest.approx((3.0, 3.0))
    spread = [rec(q, 10 + 10 * (q % 3), 10) for q in range(6)]
    low, high = tau_interval(spread)
    tau = sum(r["appended"] for r in spread) / sum(r["steps"] for r in spread)
    assert low < tau < high and tau_interval(spread) == (low, high), "seeded: the same interval every time"
    wide = high - low
    low, high = tau_interval(spread * 20)
    assert low < tau < high and high - low < wide / 3
    assert all(math.isnan(v) for v in tau_interval([]))


def test_mean_tau_interval_averages_the_benchmarks_present():
    a = [rec(q, 20, 10) for q in range(4)]
    b = [rec(q, 40, 10, bench="mt_bench") for q in range(4)]
    assert mean_tau_interval([a, [], b]) == pytest.approx((3.0, 3.0))
    assert all(math.isnan(v) for v in mean_tau_interval([[], []]))


def test_speedup_interval_pairs_each_question_with_vanilla():
    """A strategy twice as fast on every question has the degenerate interval [2, 2] however long the questions
    are (pairing); one whose questions vary in speedup gets an interval around its ratio of sums."""
    lengths = np.array([10.0, 40.0, 25.0, 60.0])
    steady = np.stack([lengths, lengths / 20, lengths, lengths / 10], axis=1)
    assert speedup_interval([steady]) == pytest.approx((2.0, 2.0))
    uneven = np.array([[48, 1.0, 48, 1.2], [48, 1.0, 48, 0.9], [48, 1.0, 48, 1.1], [48, 1.0, 48, 0.95]])
    low, high = speedup_interval([uneven[:2], np.empty((0, 4)), uneven[2:]])
    ratio = (uneven[:, 0].sum() / uneven[:, 1].sum()) / (uneven[:, 2].sum() / uneven[:, 3].sum())
    assert low < ratio < high and low < 1.0 < high, "a 4% average gain within +-20% per question is not shown"
    assert speedup_interval([uneven[:2], uneven[2:]]) == (low, high), "seeded: the same interval every time"
    assert all(math.isnan(v) for v in speedup_interval([np.empty((0, 4))]))


def test_a_resample_draws_questions_with_all_their_records():
    records = [rec(q, 10, 5, strategy=s, bench=b) for b in ("gsm8k", "mt_bench") for q in range(3)
               for s in ("single:math", "single:chat")]
    records += [rec(9, 10, 5, strategy="single:math", bench="svamp")]
    resampler = QuestionResampler(records, seed=3)
    assert resampler.counts() == {"gsm8k": 3, "mt_bench": 3, "svamp": 1}
    draws = [resampler.draw() for _ in range(50)]
    for drawn in draws:
        per = Counter((r["benchmark"], r["question_id"]) for r in drawn)
        assert sum(n for (b, _), n in per.items() if b == "gsm8k") == 6, "3 questions x 2 strategies"
        by_question = Counter((r["benchmark"], r["question_id"], r["strategy"]) for r in drawn)
        assert all(by_question[(b, q, "single:math")] == by_question[(b, q, "single:chat")]
                   for b, q in per if b != "svamp"), "paired: a drawn question brings every strategy"
    assert len({tuple(id(r) for r in d) for d in draws}) > 1
