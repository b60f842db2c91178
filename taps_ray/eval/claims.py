"""The eight claims of the TAPS paper, checked on the report's tables (docs/DESIGN.md, "Claims the report checks").

:data:`CLAIMS` is a table of :class:`Claim` objects: each states the claim in words, what it needs
when it cannot be measured, and a check that reads the tables at temperature 0 and answers its
status with the numbers behind it; :func:`evaluate_claims` runs them all in one loop. Drafter roles
are the names ``math``, ``chat`` and ``mixed``; a claim whose inputs are missing is "not measured".
Each claim line of the report (:func:`claim_line`) states the claim, its status and its numbers, so
the report reads on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from taps_ray.eval.tables import (
    BENCHMARK_ORDER,
    CHAT_BENCHMARKS,
    MATH_BENCHMARKS,
    Records,
    _mean,
    depth_counts,
)
from taps_ray.spec import stats

NEAR_BEST = 0.05
MIN_DEPTH_SUPPORT = 20
HOLDS, FAILS, MISSING = "holds", "does not hold", "not measured"
M, C, X = "single:math", "single:chat", "single:mixed"


def _f(x: float) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.2f}"


class _Taus:
    """tau at T = 0 per strategy and benchmark, with averages over a common benchmark set."""

    def __init__(self, rows: list[dict], benchmarks: list[str]):
        self.by = {r["strategy"]: r for r in rows if r["temperature"] == 0}
        self.benchmarks = benchmarks

    def has(self, *strategies: str) -> bool:
        return all(s in self.by for s in strategies)

    def common(self, strategies: Iterable[str]) -> list[str]:
        return [b for b in self.benchmarks if all(not math.isnan(self.by[s].get(b, math.nan)) for s in strategies)]

    def avg(self, strategy: str, benchmarks: list[str]) -> float:
        return _mean(self.by[strategy][b] for b in benchmarks)

    def pick(self, *candidates: str) -> str | None:
        """The first of ``candidates`` measured at T = 0."""
        return next((c for c in candidates if self.has(c)), None)


@dataclass(frozen=True)
class Inputs:
    """What the checks read: the report's tables, the grouped records and the T = 0 tau rows."""

    tables: dict
    data: Records
    taus: _Taus


Verdict = tuple[str, str] | None
"""(status, evidence), or None when the claim's inputs are missing (it then reads :attr:`Claim.needs`)."""


@dataclass(frozen=True)
class Claim:
    """One claim of the paper: its number, its words, what it needs, and its check."""

    id: int
    text: str
    needs: str
    check: Callable[[Inputs], Verdict]

    def evaluate(self, inputs: Inputs) -> dict:
        """``{"id", "claim", "status", "evidence"}``: the claim's row of the claims table."""
        verdict = self.check(inputs)
        status, evidence = verdict if verdict is not None else (MISSING, self.needs)
        return {"id": self.id, "claim": self.text, "status": status, "evidence": evidence}


def _specialists(i: Inputs) -> Verdict:
    taus = i.taus
    if not taus.has(M, C):
        return None
    benches = taus.common([M, C])
    math_b = [b for b in benches if b in MATH_BENCHMARKS]
    chat_b = [b for b in benches if b in CHAT_BENCHMARKS]
    checks = [taus.by[M][b] > taus.by[C][b] for b in math_b] + [taus.by[C][b] > taus.by[M][b] for b in chat_b]
    evidence = "; ".join(f"{b}: math {_f(taus.by[M][b])} vs chat {_f(taus.by[C][b])}" for b in benches)
    missing = [b for b in BENCHMARK_ORDER if b not in benches]
    if missing:
        evidence += f"; not measured: {', '.join(missing)}"
    return (MISSING if not math_b or not chat_b else HOLDS if all(checks) else FAILS), evidence


def _mixed_is_robust(i: Inputs) -> Verdict:
    taus = i.taus
    if not taus.has(M, C, X):
        return None
    benches = taus.common([M, C, X])
    avgs = {s: taus.avg(s, benches) for s in (X, M, C)}
    worst = {s: min(taus.by[s][b] for b in benches) for s in (X, M, C)}
    holds = avgs[X] >= max(avgs.values()) * (1 - NEAR_BEST)
    return (HOLDS if holds else FAILS,
            f"average tau over {', '.join(benches)}: " + ", ".join(f"{s} {_f(v)}" for s, v in avgs.items())
            + "; worst benchmark: " + ", ".join(f"{s} {_f(v)}" for s, v in worst.items())
            + f"; near-best = within {NEAR_BEST:.0%} of the best average")


def _against_singles(strategy: str | None, i: Inputs, better: bool) -> Verdict:
    """``strategy``'s average tau against single:math and single:chat: above both (``better``) or below both."""
    taus = i.taus
    if strategy is None or not taus.has(M, C):
        return None
    benches = taus.common([strategy, M, C])
    avgs = {s: taus.avg(s, benches) for s in (strategy, M, C)}
    holds = avgs[strategy] > max(avgs[M], avgs[C]) if better else avgs[strategy] < min(avgs[M], avgs[C])
    return HOLDS if holds else FAILS, "average tau: " + ", ".join(f"{s} {_f(v)}" for s, v in avgs.items())


def _averaging_hurts(i: Inputs) -> Verdict:
    return _against_singles(i.taus.pick("averaged:0.5", "averaged"), i, better=False)


def _routing_helps(i: Inputs) -> Verdict:
    return _against_singles(i.taus.pick("routed:confidence:step", "routed:confidence:request"), i, better=True)


def _merged_is_best(i: Inputs) -> Verdict:
    taus = i.taus
    merged = taus.pick("merged:union", "merged:budget")
    others = [s for s in taus.by if s != "vanilla"]
    if merged is None or len(others) < 2:
        return None
    benches = taus.common(others)
    avgs = {s: taus.avg(s, benches) for s in others}
    best = max(avgs, key=avgs.get)
    holds = avgs[merged] >= max(avgs.values())
    ranked = sorted(avgs.items(), key=lambda kv: -kv[1])
    return (HOLDS if holds else FAILS, f"{merged} {_f(avgs[merged])}; highest {best} {_f(avgs[best])}; all: "
            + ", ".join(f"{s} {_f(v)}" for s, v in ranked))


def _separation(routing: list[dict], strategy: str) -> tuple[float, float, str] | None:
    """(share of math-benchmark questions routed to ``math``, share of MT-Bench questions routed to ``chat``)."""
    rows = [r for r in routing if r["temperature"] == 0 and r["strategy"] == strategy]
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
    conf = _separation(i.tables["routing"], conf_name) if conf_name else None
    ent = _separation(i.tables["routing"], ent_name) if ent_name else None
    if conf is None or ent is None:
        return None
    sep_conf, sep_ent = (conf[0] + conf[1]) / 2, (ent[0] + ent[1]) / 2
    holds = conf[0] > 0.5 and conf[1] > 0.5 and sep_conf > sep_ent
    return (HOLDS if holds else FAILS, f"{conf[2]} (separation {_f(sep_conf)}); {ent[2]} (separation "
            f"{_f(sep_ent)}); separation = mean of the two shares")


def _rejected_entropy_higher(i: Inputs) -> Verdict:
    pooled = [r for r in i.tables["entropy"] if r["temperature"] == 0 and r["benchmark"] == "all"]
    acc_n = sum(r["accepted_tokens"] for r in pooled)
    rej_n = sum(r["rejected_tokens"] for r in pooled)
    if not acc_n or not rej_n:
        return None
    acc = sum(r["accepted_draft"] * r["accepted_tokens"] for r in pooled if r["accepted_tokens"]) / acc_n
    rej = sum(r["rejected_draft"] * r["rejected_tokens"] for r in pooled if r["rejected_tokens"]) / rej_n
    per = sum(1 for r in pooled if r["rejected_draft"] > r["accepted_draft"])
    return (HOLDS if rej > acc else FAILS,
            f"draft entropy at rejected {_f(rej)} ({rej_n} tokens) vs accepted {_f(acc)} ({acc_n} tokens), "
            f"pooled over strategies; higher at rejected in {per}/{len(pooled)} strategies")


def _acceptance_declines(i: Inputs) -> Verdict:
    spec = [r for s in i.data.speculative(0.0) for r in i.data.get(0.0, s)]
    counts = depth_counts(spec) if spec else stats.DepthCounts([], [], [])
    kept = [(d, rate) for d, (rate, n) in enumerate(zip(counts.rates(), counts.tried), start=1)
            if n >= MIN_DEPTH_SUPPORT]
    if len(kept) < 2:
        return None
    holds = all(b[1] <= a[1] for a, b in zip(kept, kept[1:])) and kept[-1][1] < kept[0][1]
    return (HOLDS if holds else FAILS, "acceptance rate by depth, pooled over strategies: "
            + ", ".join(f"d{d} {_f(rate)}" for d, rate in kept) + f" (depths tried by >= {MIN_DEPTH_SUPPORT} steps)")


CLAIMS: dict[int, Claim] = {c.id: c for c in [
    Claim(1, "The math-trained drafter has a higher tau than the chat-trained one on GSM8K, MATH-500 and SVAMP; "
             "the chat-trained one is higher on MT-Bench.",
          "needs single:math and single:chat at T=0", _specialists),
    Claim(2, f"A drafter trained on mixed math and chat data is robust: its average tau is the best, or within "
             f"{NEAR_BEST:.0%} of the best, of the mixed, math and chat drafters.",
          "needs single:mixed, single:math and single:chat at T=0", _mixed_is_robust),
    Claim(3, "Averaging the weights of the math and chat drafters (alpha = 0.5) gives a lower average tau than "
             "either of them.",
          "needs averaged:0.5 (or averaged), single:math, single:chat at T=0", _averaging_hurts),
    Claim(4, "Routing by draft confidence (verifying the tree of the drafter whose draft is more confident) gives a "
             "higher average tau than the better of the two single drafters.",
          "needs routed:confidence, single:math, single:chat at T=0", _routing_helps),
    Claim(5, "Verifying the merged trees of the two drafters gives the highest average tau of all strategies.",
          "needs merged:union and other strategies at T=0", _merged_is_best),
    Claim(6, "Confidence routing sends most math questions to the math drafter and most MT-Bench questions to the "
             "chat drafter; entropy routing separates them less clearly.",
          "needs confidence and entropy routing over drafters named math and chat, on MT-Bench and a math "
          "benchmark, at T=0", _confidence_separates),
    Claim(7, "Rejected draft tokens have a higher draft entropy than accepted ones.",
          "needs accepted and rejected draft tokens at T=0", _rejected_entropy_higher),
    Claim(8, "The acceptance rate declines with draft depth (share of the draft tokens tried at depth d that are "
             "accepted).",
          f"needs at least two depths tried by >= {MIN_DEPTH_SUPPORT} steps at T=0", _acceptance_declines),
]}
"""The claims of the TAPS paper the report checks, by number (docs/DESIGN.md, "Claims the report checks")."""


def evaluate_claims(tables: dict, data: Records) -> list[dict]:
    """Each of :data:`CLAIMS` as holds / does not hold / not measured, with its numbers (T = 0)."""
    inputs = Inputs(tables, data, _Taus(tables["tau"], data.benchmarks))
    return [claim.evaluate(inputs) for claim in CLAIMS.values()]


def claim_line(claim: dict, bold: bool = True) -> str:
    """``N. <the claim> — **<status>** (<numbers>)``: one self-contained line of the report (``bold``: the
    status in markdown bold) and of the ``taps demo`` printout (plain)."""
    status = f"**{claim['status']}**" if bold else claim["status"]
    return f"{claim['id']}. {claim['claim']} — {status} ({claim['evidence']})"
