"""The eight claims of the TAPS paper, checked on the report's tables (docs/DESIGN.md, "Claims the report checks").

:data:`CLAIMS` is a table of :class:`Claim` objects: each states the claim in words, what it needs
when it cannot be measured, and a check that reads the tables at one temperature and answers the claim's
*margin* (positive exactly when the claim holds on these numbers) with the numbers behind it.
:func:`evaluate_claims` runs them all at every temperature of the run, on its records and on paired bootstrap
resamples of its questions (:mod:`taps_ray.eval.intervals`): a claim *holds* when the whole interval of its
margin is above 0, *does not hold* when none of it is (a margin of exactly 0 is a tie, and a tie is not the
claimed difference), and is *inconclusive* when the interval spans 0 (more questions would decide it). Drafter
roles are the names ``math``, ``chat`` and ``mixed``; a claim whose inputs are missing is "not measured". Each
claim line of the report (:func:`claim_line`) states the claim, its status, its numbers, the margin's interval
and the questions behind it, so the report reads on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from taps_ray.eval.intervals import CLAIM_RESAMPLES, LEVEL, SEED, QuestionResampler, percentile_interval
from taps_ray.eval.tables import (
    BENCHMARK_ORDER,
    CHAT_BENCHMARKS,
    MATH_BENCHMARKS,
    Records,
    _mean,
    _rejected,
    routing_table,
    tau_table,
)
from taps_ray.spec import stats

MIN_DEPTH_SUPPORT = 20
MIN_CELL_TOKENS = 5
HOLDS, FAILS, INCONCLUSIVE, MISSING = "holds", "does not hold", "inconclusive", "not measured"
M, C, X = "single:math", "single:chat", "single:mixed"


def _f(x: float) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.2f}"


class _Taus:
    """tau at one temperature per strategy and benchmark, with averages over a common benchmark set."""

    def __init__(self, rows: list[dict], benchmarks: list[str], temperature: float):
        self.by = {r["strategy"]: r for r in rows if r["temperature"] == temperature}
        self.benchmarks = benchmarks

    def has(self, *strategies: str) -> bool:
        return all(s in self.by for s in strategies)

    def common(self, strategies: Iterable[str]) -> list[str]:
        return [b for b in self.benchmarks if all(not math.isnan(self.by[s].get(b, math.nan)) for s in strategies)]

    def avg(self, strategy: str, benchmarks: list[str]) -> float:
        return _mean(self.by[strategy][b] for b in benchmarks)

    def pick(self, *candidates: str) -> str | None:
        """The first of ``candidates`` measured at this temperature."""
        return next((c for c in candidates if self.has(c)), None)


class Inputs:
    """What the checks read at ``temperature``, computed on first use from ``data`` (grouped records): the routing
    table, the tau rows, and per-record sums of draft entropy and per-depth outcomes, kept in ``cache`` (shared
    by the inputs of one run's resamples, whose records are the run's own)."""

    def __init__(self, data: Records, temperature: float = 0.0, cache: dict | None = None):
        self.data, self.temperature = data, temperature
        self.cache = {} if cache is None else cache

    def entropy_sums(self, record: dict) -> tuple:
        """(sum, count) of the draft entropies of ``record``'s accepted tokens, then of its rejected ones, then the
        same two of the verifier's (target) entropies: 8 numbers."""
        key = ("entropy", id(record))
        if key not in self.cache:
            sums = []
            for kind in ("draft", "target"):
                accepted = [v for step in record.get(f"{kind}_entropy", []) for v in step if v is not None]
                rejected = [v for v in record.get(f"rejected_{kind}_entropy", []) if v is not None]
                sums += [sum(accepted), len(accepted), sum(rejected), len(rejected)]
            self.cache[key] = tuple(sums)
        return self.cache[key]

    def deepest(self, record: dict) -> int:
        """The deepest tree ``record`` verified (0: none)."""
        key = ("deepest", id(record))
        if key not in self.cache:
            self.cache[key] = max(record.get("tree_depth", []), default=0)
        return self.cache[key]

    def depth_tally(self, record: dict, max_depth: int) -> np.ndarray:
        """``record``'s per-depth accepted / rejected / leaf step counts over depths 1 .. ``max_depth``: [3, D]."""
        key = ("depth", id(record), max_depth)
        if key not in self.cache:
            outcomes = (stats.step_outcome(a, rej) for a, rej in zip(record["accepted"], _rejected(record)))
            counts = stats.depth_counts(outcomes, max_depth)
            self.cache[key] = np.array([counts.accepted, counts.rejected, counts.leaf], dtype=np.int64)
        return self.cache[key]

    @cached_property
    def taus(self) -> _Taus:
        return _Taus(tau_table(self.data, intervals=False), self.data.benchmarks, self.temperature)

    @cached_property
    def routing(self) -> list[dict]:
        return routing_table(self.data)


Verdict = tuple[float, str] | None
"""(margin, evidence): the margin is positive exactly when the claim holds on these numbers; None when the
claim's inputs are missing (it then reads :attr:`Claim.needs`)."""


@dataclass(frozen=True)
class Claim:
    """One claim of the paper: its number, its words, what it needs, and its check."""

    id: int | str
    text: str
    needs: str
    check: Callable[[Inputs], Verdict]

    def evaluate(self, inputs: Inputs, resampled: list[Inputs], questions: str) -> dict:
        """``{"id", "claim", "status", "evidence", "margin", "low", "high"}``: the claim's row of the claims table,
        its status from the interval of its margin over the ``resampled`` inputs (``questions``: how many
        questions per benchmark they resample, for the evidence)."""
        verdict = self.check(inputs)
        if verdict is None:
            return {"id": self.id, "claim": self.text, "status": MISSING, "evidence": self.needs,
                    "margin": None, "low": None, "high": None}
        margin, evidence = verdict
        margins = [m[0] if (m := self.check(x)) is not None else math.nan for x in resampled]
        low, high = percentile_interval(margins)
        decided = sum(not math.isnan(m) for m in margins)
        if not resampled or decided < len(resampled) / 2 or math.isnan(low):
            status = INCONCLUSIVE
        else:
            status = HOLDS if low > 0 else FAILS if high <= 0 else INCONCLUSIVE
        evidence += (f"; margin {margin:+.3f}, {LEVEL:.0%} interval [{low:+.3f}, {high:+.3f}] over "
                     f"{len(resampled)} paired resamples of n = {questions}")
        return {"id": self.id, "claim": self.text, "status": status, "evidence": evidence,
                "margin": margin, "low": low, "high": high}


def _specialists(i: Inputs) -> Verdict:
    taus = i.taus
    if not taus.has(M, C):
        return None
    benches = taus.common([M, C])
    math_b = [b for b in benches if b in MATH_BENCHMARKS]
    chat_b = [b for b in benches if b in CHAT_BENCHMARKS]
    if not math_b or not chat_b:
        return None
    gaps = [taus.by[M][b] - taus.by[C][b] for b in math_b] + [taus.by[C][b] - taus.by[M][b] for b in chat_b]
    evidence = "; ".join(f"{b}: math {_f(taus.by[M][b])} vs chat {_f(taus.by[C][b])}" for b in benches)
    missing = [b for b in BENCHMARK_ORDER if b not in benches]
    if missing:
        evidence += f"; not measured: {', '.join(missing)}"
    return min(gaps), evidence + "; margin = the smallest lead of the benchmark's own specialist"


def _mixed_is_robust(i: Inputs) -> Verdict:
    taus = i.taus
    if not taus.has(M, C, X):
        return None
    benches = taus.common([M, C, X])
    if not benches:
        return None
    avgs = {s: taus.avg(s, benches) for s in (X, M, C)}
    regret = {s: max(max(taus.by[o][b] for o in (X, M, C)) - taus.by[s][b] for b in benches) for s in (X, M, C)}
    return (min(regret[M], regret[C]) - regret[X],
            f"average tau over {', '.join(benches)}: " + ", ".join(f"{s} {_f(v)}" for s, v in avgs.items())
            + "; largest shortfall from the best of the three on a benchmark: "
            + ", ".join(f"{s} {_f(v)}" for s, v in regret.items())
            + "; margin = the specialists' smaller largest shortfall - the mixed drafter's")


def _against_singles(strategy: str | None, i: Inputs, better: bool) -> Verdict:
    """``strategy``'s average tau against single:math and single:chat: above both (``better``) or below both."""
    taus = i.taus
    if strategy is None or not taus.has(M, C):
        return None
    benches = taus.common([strategy, M, C])
    avgs = {s: taus.avg(s, benches) for s in (strategy, M, C)}
    margin = avgs[strategy] - max(avgs[M], avgs[C]) if better else min(avgs[M], avgs[C]) - avgs[strategy]
    return margin, "average tau: " + ", ".join(f"{s} {_f(v)}" for s, v in avgs.items())


def _averaging_hurts(i: Inputs) -> Verdict:
    return _against_singles(i.taus.pick("averaged:0.5", "averaged"), i, better=False)


def _routing_helps(i: Inputs) -> Verdict:
    return _against_singles(i.taus.pick("routed:confidence:step", "routed:confidence:request"), i, better=True)


def _merged_beats(merged: str, leave_out: tuple[str, ...], i: Inputs) -> Verdict:
    """``merged``'s average tau against every other speculative strategy but ``leave_out``, with the mean nodes
    each verified per step (a union verifies up to the sum of its trees)."""
    taus = i.taus
    others = [s for s in taus.by if s != "vanilla" and s not in leave_out]
    if merged not in taus.by or len(others) < 2:
        return None
    benches = taus.common(others)
    avgs = {s: taus.avg(s, benches) for s in others}
    best = max((s for s in avgs if s != merged), key=avgs.get)
    ranked = sorted(avgs.items(), key=lambda kv: -kv[1])
    nodes = {s: _mean(n for r in i.data.get(i.temperature, s) for n in r["tree_size"]) for s in (merged, best)}
    return (avgs[merged] - avgs[best],
            f"{merged} {_f(avgs[merged])} ({_f(nodes[merged])} nodes verified per step); highest other {best} "
            f"{_f(avgs[best])} ({_f(nodes[best])} nodes); all: " + ", ".join(f"{s} {_f(v)}" for s, v in ranked)
            + "; margin = merged - the best other")


def _union_is_best(i: Inputs) -> Verdict:
    return _merged_beats("merged:union", (), i)


def _budget_merge_is_best(i: Inputs) -> Verdict:
    return _merged_beats("merged:budget", ("merged:union",), i)


def _separation(routing: list[dict], strategy: str, temperature: float) -> tuple[float, float, str] | None:
    """(share of math-benchmark questions routed to ``math``, share of MT-Bench questions routed to ``chat``)."""
    rows = [r for r in routing if r["temperature"] == temperature and r["strategy"] == strategy]
    math_rows = [r for r in rows if r["benchmark"] in MATH_BENCHMARKS and r["drafter"] == "math"]
    chat_rows = [r for r in rows if r["benchmark"] in CHAT_BENCHMARKS and r["drafter"] == "chat"]
    if not math_rows or not chat_rows:
        return None
    math_share = sum(r["questions"] for r in math_rows) / max(1, sum(r["of_questions"] for r in math_rows))
    chat_share = sum(r["questions"] for r in chat_rows) / max(1, sum(r["of_questions"] for r in chat_rows))
    detail = (f"{strategy}: {sum(r['questions'] for r in math_rows)}/{sum(r['of_questions'] for r in math_rows)} "
              f"math-benchmark questions to math, {sum(r['questions'] for r in chat_rows)}/"
              f"{sum(r['of_questions'] for r in chat_rows)} MT-Bench questions to chat")
    return math_share, chat_share, detail


def _confidence_separates(i: Inputs) -> Verdict:
    conf_name = i.taus.pick("routed:confidence:step", "routed:confidence:request")
    ent_name = i.taus.pick("routed:entropy:request", "routed:entropy:step")
    conf = _separation(i.routing, conf_name, i.temperature) if conf_name else None
    ent = _separation(i.routing, ent_name, i.temperature) if ent_name else None
    if conf is None or ent is None:
        return None
    sep_conf, sep_ent = (conf[0] + conf[1]) / 2, (ent[0] + ent[1]) / 2
    margin = min(conf[0] - 0.5, conf[1] - 0.5, sep_conf - sep_ent)
    return (margin, f"{conf[2]} (separation {_f(sep_conf)}); {ent[2]} (separation "
            f"{_f(sep_ent)}); separation = mean of the two shares; margin = the least of both confidence shares - 0.5 "
            "and the separations' difference")


def _rejected_entropy_higher(i: Inputs) -> Verdict:
    """Draft entropy higher at rejected than at accepted tokens in every cell (strategy x benchmark) with
    at least :data:`MIN_CELL_TOKENS` rejected tokens; the verifier's entropy delta is reported beside it."""
    t, cells = i.temperature, {}
    for s in i.data.speculative(t):
        for b in i.data.benchmarks:
            records = i.data.get(t, s, b)
            if records:
                cells[(s, b)] = np.array([i.entropy_sums(r) for r in records], dtype=float).sum(axis=0)
    deltas = {k: v[2] / v[3] - v[0] / v[1] for k, v in cells.items() if v[1] and v[3] >= MIN_CELL_TOKENS}
    if not deltas:
        return None
    total = sum(cells.values(), np.zeros(8))
    draft = (total[2] / total[3], total[0] / total[1])
    verifier = (total[6] / total[7], total[4] / total[5]) if total[5] and total[7] else (math.nan, math.nan)
    worst = min(deltas, key=deltas.get)
    return (min(deltas.values()),
            f"rejected - accepted draft entropy higher in {sum(d > 0 for d in deltas.values())}/{len(deltas)} cells "
            f"(strategy x benchmark, >= {MIN_CELL_TOKENS} rejected tokens; smallest {_f(deltas[worst])} in "
            f"{worst[0]} on {worst[1]}); pooled: draft entropy at rejected {_f(draft[0])} ({int(total[3])} tokens) vs "
            f"accepted {_f(draft[1])} ({int(total[1])} tokens), verifier entropy at rejected {_f(verifier[0])} vs "
            f"accepted {_f(verifier[1])}; margin = the smallest cell's delta")


def _slope(points: list[tuple[int, float]]) -> float:
    """The least-squares slope of rate over depth."""
    depths = np.array([d for d, _ in points], dtype=float)
    rates = np.array([r for _, r in points])
    centred = depths - depths.mean()
    return float((centred * (rates - rates.mean())).sum() / (centred ** 2).sum())


def _acceptance_declines(i: Inputs) -> Verdict:
    """Per speculative strategy, the least-squares slope of acceptance over the depths tried by at least
    :data:`MIN_DEPTH_SUPPORT` steps is negative."""
    t, slopes, rates = i.temperature, {}, {}
    for s in i.data.speculative(t):
        records = i.data.get(t, s)
        max_depth = max((i.deepest(r) for r in records), default=0)
        if not max_depth:
            continue
        accepted, rejected, _ = sum(i.depth_tally(r, max_depth) for r in records)
        tried = accepted + rejected
        kept = [(d, a / n) for d, (a, n) in enumerate(zip(accepted, tried), start=1) if n >= MIN_DEPTH_SUPPORT]
        if len(kept) >= 2:
            slopes[s], rates[s] = _slope(kept), kept
    if not slopes:
        return None
    flattest = max(slopes, key=slopes.get)
    return (-slopes[flattest],
            f"slope of acceptance per depth negative in {sum(v < 0 for v in slopes.values())}/{len(slopes)} strategies "
            f"(depths tried by >= {MIN_DEPTH_SUPPORT} steps); flattest {flattest} {slopes[flattest]:+.3f} per depth ("
            + ", ".join(f"d{d} {_f(rate)}" for d, rate in rates[flattest]) + "); margin = -(the flattest slope)")


CLAIMS: dict[int | str, Claim] = {c.id: c for c in [
    Claim(1, "The math-trained drafter has a higher tau than the chat-trained one on GSM8K, MATH-500 and SVAMP; "
             "the chat-trained one is higher on MT-Bench.",
          "needs single:math and single:chat", _specialists),
    Claim(2, "A drafter trained on mixed math and chat data is robust: its largest shortfall from the best of the "
             "mixed, math and chat drafters on any benchmark is the smallest of the three (minimax regret).",
          "needs single:mixed, single:math and single:chat", _mixed_is_robust),
    Claim(3, "Averaging the weights of the math and chat drafters (alpha = 0.5) gives a lower average tau than "
             "either of them.",
          "needs averaged:0.5 (or averaged), single:math, single:chat", _averaging_hurts),
    Claim(4, "Routing by draft confidence (verifying the tree of the drafter whose draft is more confident) gives a "
             "higher average tau than the better of the two single drafters.",
          "needs routed:confidence, single:math, single:chat", _routing_helps),
    Claim(5, "Verifying the merged trees of the two drafters (their union, which verifies up to both trees' "
             "nodes) gives the highest average tau of all strategies.",
          "needs merged:union and other strategies", _union_is_best),
    Claim("5b", "Merging within the node budget of one tree (merged:budget) gives a higher average tau than every "
                "other strategy with that budget (all but the union).",
          "needs merged:budget and other strategies", _budget_merge_is_best),
    Claim(6, "Confidence routing sends most math questions to the math drafter and most MT-Bench questions to the "
             "chat drafter; entropy routing separates them less clearly.",
          "needs confidence and entropy routing over drafters named math and chat, on MT-Bench and a math "
          "benchmark", _confidence_separates),
    Claim(7, "Rejected draft tokens have a higher draft entropy than accepted ones, in every strategy and benchmark.",
          "needs accepted and rejected draft tokens", _rejected_entropy_higher),
    Claim(8, "The acceptance rate declines with draft depth (share of the draft tokens tried at depth d that are "
             "accepted), for every strategy.",
          f"needs at least two depths tried by >= {MIN_DEPTH_SUPPORT} steps", _acceptance_declines),
]}
"""The claims of the TAPS paper the report checks, by number (docs/DESIGN.md, "Claims the report checks")."""


def evaluate_claims(data: Records, resamples: int = CLAIM_RESAMPLES, seed: int = SEED) -> list[dict]:
    """Each of :data:`CLAIMS` at each temperature of ``data`` as holds / does not hold / inconclusive / not
    measured, with its numbers and the interval of its margin over ``resamples`` paired bootstrap resamples of
    the questions (the same resamples at every temperature); each row has its ``temperature``."""
    resampler = QuestionResampler(data.records, seed)
    cache: dict = {}
    drawn = [Records(resampler.draw()) for _ in range(resamples)]
    counts = resampler.counts()
    sizes = sorted(set(counts.values()))
    questions = (f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}") if sizes else "0"
    questions += " questions per benchmark"
    rows = []
    for t in data.temperatures or [0.0]:
        resampled = [Inputs(d, t, cache) for d in drawn]
        rows += [{**claim.evaluate(Inputs(data, t, cache), resampled, questions), "temperature": t}
                 for claim in CLAIMS.values()]
    return rows


def claim_line(claim: dict, bold: bool = True) -> str:
    """``N. <the claim> — **<status>** (<numbers>)``: one self-contained line of the report (``bold``: the
    status in markdown bold) and of the ``taps demo`` printout (plain)."""
    status = f"**{claim['status']}**" if bold else claim["status"]
    return f"{claim['id']}. {claim['claim']} — {status} ({claim['evidence']})"
