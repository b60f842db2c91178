"""The evaluation report: ``report.md``, ``tables/*.csv``, ``plots/*.png`` and ``summary.json`` from records.

Every number comes from ``records.jsonl`` with the metric definitions of :mod:`taps_ray.spec.stats`:
tau = appended tokens / steps over a benchmark's questions (micro; ``tau_q`` is the mean of
per-question tau), the average column is the mean over benchmarks (paper Table 1). Per-depth
acceptance at depth d = accepted / (accepted + rejected) draft tokens at d; steps whose accepted
path ended at a leaf before d tried nothing there and are counted apart (``leaf<d>``), not as
rejections. A question is routed to the drafter that verified most of its steps. Speedup = tokens/s of a
strategy / tokens/s of vanilla on the same questions of the same run. The eight claims of the TAPS
paper (:data:`CLAIMS`; docs/DESIGN.md, "Claims the report checks") are evaluated at temperature 0
from these tables; drafter roles are the names ``math``, ``chat`` and ``mixed``; a claim whose
inputs are missing is "not measured". Each claim line of the report states the claim in words, its
status and the numbers behind it (:func:`claim_line`), so the report reads on its own.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from taps_ray.eval.records import RECORDS, RUN_FILE, read_records
from taps_ray.runstate import atomic_write, write_json
from taps_ray.spec import stats

MATH_BENCHMARKS = ("gsm8k", "math_500", "svamp")
CHAT_BENCHMARKS = ("mt_bench",)
BENCHMARK_ORDER = ("mt_bench", "gsm8k", "math_500", "svamp")
NEAR_BEST = 0.05
MIN_DEPTH_SUPPORT = 20
HOLDS, FAILS, MISSING = "holds", "does not hold", "not measured"


def _mean(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def _tau(records: list[dict]) -> float:
    return stats.acceptance_length(sum(r["appended"] for r in records), sum(r["steps"] for r in records))


def _order(names: Iterable[str], reference: Iterable[str]) -> list[str]:
    reference = list(reference)
    return sorted(set(names), key=lambda n: (reference.index(n) if n in reference else len(reference), n))


def _strategy_key(name: str) -> tuple:
    kinds = ["vanilla", "single", "averaged", "routed", "merged"]
    kind = name.split(":")[0]
    alpha = name.split(":")[1] if kind == "averaged" and ":" in name else ""
    return (kinds.index(kind) if kind in kinds else len(kinds), float(alpha) if alpha else 0.0, name)


def _alpha(name: str) -> float | None:
    parts = name.split(":")
    return float(parts[1]) if parts[0] == "averaged" and len(parts) == 2 else None


class Records:
    """Records grouped by temperature, strategy and benchmark."""

    def __init__(self, records: list[dict]):
        self.records = records
        self.groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in records:
            self.groups[(float(r["temperature"]), r["strategy"], r["benchmark"])].append(r)
        self.temperatures = sorted({k[0] for k in self.groups})
        self.strategies = sorted({k[1] for k in self.groups}, key=_strategy_key)
        self.benchmarks = _order({k[2] for k in self.groups}, BENCHMARK_ORDER)

    def get(self, t: float, strategy: str, benchmark: str | None = None) -> list[dict]:
        if benchmark is not None:
            return self.groups.get((t, strategy, benchmark), [])
        return [r for b in self.benchmarks for r in self.groups.get((t, strategy, b), [])]

    def speculative(self, t: float) -> list[str]:
        return [s for s in self.strategies if s != "vanilla" and self.get(t, s)]


# -- tables ---------------------------------------------------------------------------------------

def tau_table(data: Records) -> list[dict]:
    """Rows (temperature, strategy): tau per benchmark, their mean ``avg``, per-question means, counts."""
    rows = []
    for t in data.temperatures:
        for s in data.strategies:
            if not data.get(t, s):
                continue
            row = {"temperature": t, "strategy": s}
            for b in data.benchmarks:
                group = data.get(t, s, b)
                row[b] = _tau(group) if group else math.nan
                row[f"{b}_tau_q"] = stats.mean_tau(r["tau"] for r in group)
                row[f"{b}_n"] = len(group)
            row["avg"] = _mean(row[b] for b in data.benchmarks)
            rows.append(row)
    return rows


def routing_table(data: Records) -> list[dict]:
    """Rows (temperature, strategy, benchmark, drafter) of routed strategies: share of steps and of
    questions (by majority of their steps) routed to each drafter, mean signal when it was chosen."""
    rows = []
    for t in data.temperatures:
        for s in (s for s in data.strategies if s.startswith("routed:")):
            for b in data.benchmarks:
                group = data.get(t, s, b)
                if not group:
                    continue
                names = list(dict.fromkeys(n for r in group for n in r["drafters"]))
                steps = Counter(route for r in group for route in r.get("routes", []))
                majority = Counter(Counter(r["routes"]).most_common(1)[0][0] for r in group if r.get("routes"))
                total_steps, total_q = sum(steps.values()), sum(majority.values())
                for i, name in enumerate(names):
                    chosen = [sig[i] for r in group for route, sig in zip(r.get("routes", []), r.get("signals", []))
                              if route == name and sig and sig[i] is not None]
                    rows.append({"temperature": t, "strategy": s, "benchmark": b, "drafter": name,
                                 "step_share": steps[name] / total_steps if total_steps else math.nan,
                                 "question_share": majority[name] / total_q if total_q else math.nan,
                                 "questions": majority[name], "of_questions": total_q,
                                 "mean_signal_when_chosen": _mean(chosen)})
    return rows


def speculative_groups(data: Records):
    """Yield (temperature, strategy, benchmark | "all", records) for every non-empty speculative group."""
    for t in data.temperatures:
        for s in data.speculative(t):
            for b in [*data.benchmarks, "all"]:
                group = data.get(t, s, None if b == "all" else b)
                if group:
                    yield t, s, b, group


def entropy_table(data: Records) -> list[dict]:
    """Rows (temperature, strategy, benchmark | all): mean draft / target entropy at accepted and at
    rejected draft tokens (the first tried child at the first failing depth)."""
    rows = []
    for t, s, b, group in speculative_groups(data):
        acc_d = [v for r in group for step in r.get("draft_entropy", []) for v in step if v is not None]
        acc_t = [v for r in group for step in r.get("target_entropy", []) for v in step if v is not None]
        rej_d = [v for r in group for v in r.get("rejected_draft_entropy", []) if v is not None]
        rej_t = [v for r in group for v in r.get("rejected_target_entropy", []) if v is not None]
        rows.append({"temperature": t, "strategy": s, "benchmark": b,
                     "accepted_draft": _mean(acc_d), "rejected_draft": _mean(rej_d),
                     "accepted_target": _mean(acc_t), "rejected_target": _mean(rej_t),
                     "accepted_tokens": len(acc_d), "rejected_tokens": len(rej_d)})
    return rows


def _rejected(record: dict) -> list[bool]:
    """Per step: whether a draft token was rejected (records without ``rejected`` tell it by the
    rejected token's entropy, None when the path ended at a leaf)."""
    if "rejected" in record:
        return record["rejected"]
    return [e is not None for e in record.get("rejected_draft_entropy", [None] * len(record["accepted"]))]


def depth_counts(group: list[dict]) -> stats.DepthCounts:
    """Per-depth accepted / rejected / ended-at-a-leaf step counts of records, depth 1 .. the deepest tree."""
    max_depth = max((d for r in group for d in r.get("tree_depth", [])), default=0)
    outcomes = (stats.step_outcome(a, rej) for r in group for a, rej in zip(r["accepted"], _rejected(r)))
    return stats.depth_counts(outcomes, max_depth)


def depth_table(data: Records) -> list[dict]:
    """Rows (temperature, strategy, benchmark | all), per depth d = 1 .. D+1: acceptance ``d<d>`` of the
    tokens tried there, tokens tried ``n<d>``, steps whose path ended at a leaf before d ``leaf<d>``."""
    rows = []
    for t, s, b, group in speculative_groups(data):
        counts = depth_counts(group)
        row = {"temperature": t, "strategy": s, "benchmark": b}
        for d, (rate, n, leaf) in enumerate(zip(counts.rates(), counts.tried, counts.leaf), start=1):
            row[f"d{d}"], row[f"n{d}"], row[f"leaf{d}"] = rate, n, leaf
        rows.append(row)
    return rows


def alpha_table(data: Records) -> list[dict]:
    """Rows (temperature, alpha): tau per benchmark and their mean for ``averaged:ALPHA`` strategies."""
    rows = []
    for t in data.temperatures:
        for s in data.strategies:
            alpha = _alpha(s)
            if alpha is None or not data.get(t, s):
                continue
            row = {"temperature": t, "alpha": alpha, "strategy": s}
            for b in data.benchmarks:
                group = data.get(t, s, b)
                row[b] = _tau(group) if group else math.nan
            row["avg"] = _mean(row[b] for b in data.benchmarks)
            rows.append(row)
    return sorted(rows, key=lambda r: (r["temperature"], r["alpha"]))


def speed_table(data: Records) -> list[dict]:
    """Rows (temperature, strategy): tokens/s against vanilla on the same questions, speedup, tau,
    verified tree size (and the union before pruning), draft / verify ms per step, share of questions
    whose output equals vanilla's (greedy losslessness, T = 0)."""
    rows = []
    for t in data.temperatures:
        vanilla = {(r["benchmark"], str(r["question_id"])): r for r in data.get(t, "vanilla")}
        for s in data.strategies:
            group = [r for r in data.get(t, s) if (r["benchmark"], str(r["question_id"])) in vanilla]
            if not group:
                continue
            base = [vanilla[(r["benchmark"], str(r["question_id"]))] for r in group]
            tps = sum(sum(r["new_tokens"]) for r in group) / sum(r["total_s"] for r in group)
            base_tps = sum(sum(r["new_tokens"]) for r in base) / sum(r["total_s"] for r in base)
            steps = sum(r["steps"] for r in group)
            sizes = [x for r in group for x in r["tree_size"]]
            unions = [x for r in group for x in r.get("union_size", r["tree_size"])]
            same = sum(r["output_crc"] == v["output_crc"] for r, v in zip(group, base))
            rows.append({"temperature": t, "strategy": s, "questions": len(group), "tau": _tau(group),
                         "tokens_per_s": tps, "vanilla_tokens_per_s": base_tps, "speedup": tps / base_tps,
                         "tree_size": _mean(sizes), "union_size": _mean(unions),
                         "draft_ms_per_step": 1e3 * sum(r["draft_s"] for r in group) / steps if steps else math.nan,
                         "verify_ms_per_step": 1e3 * sum(r["verify_s"] for r in group) / steps if steps else math.nan,
                         "same_output_as_vanilla": same / len(group) if t == 0 else math.nan})
    return rows


# -- claims ---------------------------------------------------------------------------------------

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


def _claim(number: int, text: str, status: str, evidence: str) -> dict:
    return {"id": number, "claim": text, "status": status, "evidence": evidence}


CLAIMS = {
    1: "The math-trained drafter has a higher tau than the chat-trained one on GSM8K, MATH-500 and SVAMP; "
       "the chat-trained one is higher on MT-Bench.",
    2: f"A drafter trained on mixed math and chat data is robust: its average tau is the best, or within "
       f"{NEAR_BEST:.0%} of the best, of the mixed, math and chat drafters.",
    3: "Averaging the weights of the math and chat drafters (alpha = 0.5) gives a lower average tau than "
       "either of them.",
    4: "Routing by draft confidence (verifying the tree of the drafter whose draft is more confident) gives a "
       "higher average tau than the better of the two single drafters.",
    5: "Verifying the merged trees of the two drafters gives the highest average tau of all strategies.",
    6: "Confidence routing sends most math questions to the math drafter and most MT-Bench questions to the "
       "chat drafter; entropy routing separates them less clearly.",
    7: "Rejected draft tokens have a higher draft entropy than accepted ones.",
    8: "The acceptance rate declines with draft depth (share of the draft tokens tried at depth d that are "
       "accepted).",
}
"""The claims of the TAPS paper the report checks, as measured here (docs/DESIGN.md, "Claims the report checks")."""


def claim_line(claim: dict, bold: bool = True) -> str:
    """``N. <the claim> — **<status>** (<numbers>)``: one self-contained line of the report (``bold``: the
    status in markdown bold) and of the ``taps demo`` printout (plain)."""
    status = f"**{claim['status']}**" if bold else claim["status"]
    return f"{claim['id']}. {claim['claim']} — {status} ({claim['evidence']})"


def _pick(taus: _Taus, *candidates: str) -> str | None:
    return next((c for c in candidates if taus.has(c)), None)


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


def evaluate_claims(tables: dict, data: Records) -> list[dict]:
    """Each of :data:`CLAIMS` as holds / does not hold / not measured, with its numbers (T = 0)."""
    taus = _Taus(tables["tau"], data.benchmarks)
    out = []
    m, c, x = "single:math", "single:chat", "single:mixed"

    if not taus.has(m, c):
        out.append(_claim(1, CLAIMS[1], MISSING, "needs single:math and single:chat at T=0"))
    else:
        benches = taus.common([m, c])
        math_b = [b for b in benches if b in MATH_BENCHMARKS]
        chat_b = [b for b in benches if b in CHAT_BENCHMARKS]
        checks = [taus.by[m][b] > taus.by[c][b] for b in math_b] + [taus.by[c][b] > taus.by[m][b] for b in chat_b]
        evidence = "; ".join(f"{b}: math {_f(taus.by[m][b])} vs chat {_f(taus.by[c][b])}" for b in benches)
        missing = [b for b in BENCHMARK_ORDER if b not in benches]
        if missing:
            evidence += f"; not measured: {', '.join(missing)}"
        status = MISSING if not math_b or not chat_b else HOLDS if all(checks) else FAILS
        out.append(_claim(1, CLAIMS[1], status, evidence))

    if not taus.has(m, c, x):
        out.append(_claim(2, CLAIMS[2], MISSING, "needs single:mixed, single:math and single:chat at T=0"))
    else:
        benches = taus.common([m, c, x])
        avgs = {s: taus.avg(s, benches) for s in (x, m, c)}
        worst = {s: min(taus.by[s][b] for b in benches) for s in (x, m, c)}
        best = max(avgs.values())
        holds = avgs[x] >= best * (1 - NEAR_BEST)
        out.append(_claim(2, CLAIMS[2], HOLDS if holds else FAILS,
                          f"average tau over {', '.join(benches)}: " + ", ".join(f"{s} {_f(v)}" for s, v in avgs.items())
                          + "; worst benchmark: " + ", ".join(f"{s} {_f(v)}" for s, v in worst.items())
                          + f"; near-best = within {NEAR_BEST:.0%} of the best average"))

    averaged = _pick(taus, "averaged:0.5", "averaged")
    if averaged is None or not taus.has(m, c):
        out.append(_claim(3, CLAIMS[3], MISSING, "needs averaged:0.5 (or averaged), single:math, single:chat at T=0"))
    else:
        benches = taus.common([averaged, m, c])
        avgs = {s: taus.avg(s, benches) for s in (averaged, m, c)}
        holds = avgs[averaged] < min(avgs[m], avgs[c])
        out.append(_claim(3, CLAIMS[3], HOLDS if holds else FAILS,
                          "average tau: " + ", ".join(f"{s} {_f(v)}" for s, v in avgs.items())))

    routed = _pick(taus, "routed:confidence:step", "routed:confidence:request")
    if routed is None or not taus.has(m, c):
        out.append(_claim(4, CLAIMS[4], MISSING, "needs routed:confidence, single:math, single:chat at T=0"))
    else:
        benches = taus.common([routed, m, c])
        avgs = {s: taus.avg(s, benches) for s in (routed, m, c)}
        holds = avgs[routed] > max(avgs[m], avgs[c])
        out.append(_claim(4, CLAIMS[4], HOLDS if holds else FAILS,
                          "average tau: " + ", ".join(f"{s} {_f(v)}" for s, v in avgs.items())))

    merged = _pick(taus, "merged:union", "merged:budget")
    others = [s for s in taus.by if s != "vanilla"]
    if merged is None or len(others) < 2:
        out.append(_claim(5, CLAIMS[5], MISSING, "needs merged:union and other strategies at T=0"))
    else:
        benches = taus.common(others)
        avgs = {s: taus.avg(s, benches) for s in others}
        best = max(avgs, key=avgs.get)
        holds = avgs[merged] >= max(avgs.values())
        ranked = sorted(avgs.items(), key=lambda kv: -kv[1])
        out.append(_claim(5, CLAIMS[5], HOLDS if holds else FAILS,
                          f"{merged} {_f(avgs[merged])}; highest {best} {_f(avgs[best])}; all: "
                          + ", ".join(f"{s} {_f(v)}" for s, v in ranked)))

    conf_name = _pick(taus, "routed:confidence:step", "routed:confidence:request")
    ent_name = _pick(taus, "routed:entropy:request", "routed:entropy:step")
    conf = _separation(tables["routing"], conf_name) if conf_name else None
    ent = _separation(tables["routing"], ent_name) if ent_name else None
    if conf is None or ent is None:
        out.append(_claim(6, CLAIMS[6], MISSING, "needs confidence and entropy routing over drafters named math and "
                          "chat, on MT-Bench and a math benchmark, at T=0"))
    else:
        sep_conf, sep_ent = (conf[0] + conf[1]) / 2, (ent[0] + ent[1]) / 2
        holds = conf[0] > 0.5 and conf[1] > 0.5 and sep_conf > sep_ent
        out.append(_claim(6, CLAIMS[6], HOLDS if holds else FAILS,
                          f"{conf[2]} (separation {_f(sep_conf)}); {ent[2]} (separation {_f(sep_ent)}); "
                          "separation = mean of the two shares"))

    pooled = [r for r in tables["entropy"] if r["temperature"] == 0 and r["benchmark"] == "all"]
    acc_n = sum(r["accepted_tokens"] for r in pooled)
    rej_n = sum(r["rejected_tokens"] for r in pooled)
    if not acc_n or not rej_n:
        out.append(_claim(7, CLAIMS[7], MISSING, "needs accepted and rejected draft tokens at T=0"))
    else:
        acc = sum(r["accepted_draft"] * r["accepted_tokens"] for r in pooled if r["accepted_tokens"]) / acc_n
        rej = sum(r["rejected_draft"] * r["rejected_tokens"] for r in pooled if r["rejected_tokens"]) / rej_n
        per = sum(1 for r in pooled if r["rejected_draft"] > r["accepted_draft"])
        out.append(_claim(7, CLAIMS[7], HOLDS if rej > acc else FAILS,
                          f"draft entropy at rejected {_f(rej)} ({rej_n} tokens) vs accepted {_f(acc)} ({acc_n} tokens), "
                          f"pooled over strategies; higher at rejected in {per}/{len(pooled)} strategies"))

    spec = [r for s in data.speculative(0.0) for r in data.get(0.0, s)]
    counts = depth_counts(spec) if spec else stats.DepthCounts([], [], [])
    kept = [(d, rate) for d, (rate, n) in enumerate(zip(counts.rates(), counts.tried), start=1)
            if n >= MIN_DEPTH_SUPPORT]
    if len(kept) < 2:
        out.append(_claim(8, CLAIMS[8], MISSING, f"needs at least two depths tried by >= {MIN_DEPTH_SUPPORT} steps at T=0"))
    else:
        holds = all(b[1] <= a[1] for a, b in zip(kept, kept[1:])) and kept[-1][1] < kept[0][1]
        out.append(_claim(8, CLAIMS[8], HOLDS if holds else FAILS,
                          "acceptance rate by depth, pooled over strategies: "
                          + ", ".join(f"d{d} {_f(rate)}" for d, rate in kept)
                          + f" (depths tried by >= {MIN_DEPTH_SUPPORT} steps)"))
    return out


# -- output ---------------------------------------------------------------------------------------

def _fmt(value) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[str], headers: list[str] | None = None) -> str:
    headers = headers or columns
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(r.get(c, math.nan)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _plots(out: Path, tables: dict, data: Records) -> list[str]:
    import matplotlib  # only when plots are drawn: the tables need none of it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for t in data.temperatures:
        label = f"T{t:g}"
        rows = [r for r in tables["tau"] if r["temperature"] == t and r["strategy"] != "vanilla"]
        if rows:
            fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.5))
            ax.barh([r["strategy"] for r in rows][::-1], [r["avg"] for r in rows][::-1], color="#4878a8")
            ax.set_xlabel("average tau (tokens per target step)")
            ax.set_title(f"Acceptance length by strategy, T={t:g}")
            fig.tight_layout()
            written.append(_save(fig, out / f"tau_{label}.png"))
        rows = [r for r in tables["depth"] if r["temperature"] == t and r["benchmark"] == "all"]
        if rows:
            fig, ax = plt.subplots(figsize=(6, 4))
            for r in rows:
                depths = sorted(int(k[1:]) for k in r if k.startswith("d") and k[1:].isdigit())
                ax.plot(depths, [r[f"d{d}"] for d in depths], marker="o", label=r["strategy"])
            ax.set_xlabel("draft depth")
            ax.set_ylabel("acceptance rate")
            ax.set_ylim(0, 1.02)
            ax.set_title(f"Acceptance rate by depth, T={t:g}")
            ax.legend(fontsize=7)
            fig.tight_layout()
            written.append(_save(fig, out / f"acceptance_by_depth_{label}.png"))
        rows = [r for r in tables["alpha"] if r["temperature"] == t]
        if rows:
            fig, ax = plt.subplots(figsize=(6, 4))
            alphas = [r["alpha"] for r in rows]
            for b in [*data.benchmarks, "avg"]:
                ax.plot(alphas, [r.get(b, math.nan) for r in rows], marker="o", label=b,
                        linewidth=2.5 if b == "avg" else 1.2)
            ax.set_xlabel("alpha (weight of the first drafter)")
            ax.set_ylabel("tau")
            ax.set_title(f"Weight averaging: tau vs alpha, T={t:g}")
            ax.legend(fontsize=7)
            fig.tight_layout()
            written.append(_save(fig, out / f"tau_vs_alpha_{label}.png"))
        rows = [r for r in tables["speed"] if r["temperature"] == t]
        if rows:
            fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.5))
            ax.barh([r["strategy"] for r in rows][::-1], [r["speedup"] for r in rows][::-1], color="#6a9f58")
            ax.axvline(1.0, color="gray", linestyle="--")
            ax.set_xlabel("speedup vs vanilla (tokens/s ratio, same prompts)")
            ax.set_title(f"Wall-clock speedup, T={t:g}")
            fig.tight_layout()
            written.append(_save(fig, out / f"speedup_{label}.png"))
    return written


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt  # loaded by _plots, which calls this

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def build_tables(records: list[dict]) -> tuple[dict, Records]:
    data = Records(records)
    tables = {"tau": tau_table(data), "routing": routing_table(data), "entropy": entropy_table(data),
              "depth": depth_table(data), "alpha": alpha_table(data), "speed": speed_table(data)}
    tables["claims"] = evaluate_claims(tables, data)
    return tables, data


def _clean(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def render_markdown(tables: dict, data: Records, run: dict, plots: list[str]) -> str:
    b = data.benchmarks
    ident = run.get("identity", {})
    lines = ["# TAPS evaluation report", ""]
    lines += [f"- target: `{ident.get('target', {}).get('model')}`; tree: {ident.get('tree')}; "
              f"max_new_tokens: {ident.get('max_new_tokens')}",
              "- drafters: " + ", ".join(f"`{n}` = {src}" for n, src in run.get("drafters", {}).items()),
              f"- records: {len(data.records)}; temperatures: {data.temperatures}; benchmarks: {b}",
              "- tau = appended tokens per target verification step (accepted + bonus), micro-averaged per "
              "benchmark; avg = mean over benchmarks.", ""]
    lines += [f"- questions, {note}" for note in run.get("question_notes", [])] + [""] * bool(run.get("question_notes"))
    for t in data.temperatures:
        lines += [f"## Temperature {t:g}", "", "### Acceptance length tau (Table 1)", ""]
        rows = [r for r in tables["tau"] if r["temperature"] == t]
        lines += [markdown_table(rows, ["strategy", *b, "avg"]), ""]
        lines += ["Questions per cell: " + ", ".join(f"{x}: {rows[0].get(f'{x}_n', 0)}" for x in b) if rows else "", ""]
        rows = [r for r in tables["routing"] if r["temperature"] == t]
        if rows:
            lines += ["### Routing decisions (Table 2)", "",
                      "Share of verified steps and of questions (by majority of their steps) per drafter.", "",
                      markdown_table(rows, ["strategy", "benchmark", "drafter", "step_share", "question_share",
                                            "questions", "of_questions", "mean_signal_when_chosen"]), ""]
        rows = [r for r in tables["entropy"] if r["temperature"] == t and r["benchmark"] == "all"]
        if rows:
            lines += ["### Draft entropy at accepted vs rejected tokens (Table 3)", "",
                      "Nats, all benchmarks pooled; per benchmark in `tables/entropy.csv`.", "",
                      markdown_table(rows, ["strategy", "accepted_draft", "rejected_draft", "accepted_tokens",
                                            "rejected_tokens"]), "",
                      "### Verifier entropy at accepted vs rejected tokens (Table 4)", "",
                      markdown_table(rows, ["strategy", "accepted_target", "rejected_target"]), ""]
        rows = [r for r in tables["depth"] if r["temperature"] == t and r["benchmark"] == "all"]
        if rows:
            depths = sorted({int(k[1:]) for r in rows for k in r if k.startswith("d") and k[1:].isdigit()})
            lines += ["### Acceptance rate by depth (Tables 5-7)", "",
                      "Share of the draft tokens tried at depth d that were accepted, all benchmarks; a step "
                      "whose accepted path ended at a leaf before d tried nothing at d and is not a rejection. "
                      "Per benchmark, with the tokens tried (`n<d>`), in `tables/acceptance_by_depth.csv`.", "",
                      markdown_table(rows, ["strategy", *[f"d{d}" for d in depths]]), "",
                      "Steps whose accepted path ended at a leaf before depth d (no token tried there):", "",
                      markdown_table(rows, ["strategy", *[f"leaf{d}" for d in depths]]), ""]
        rows = [r for r in tables["alpha"] if r["temperature"] == t]
        if rows:
            lines += ["### tau vs interpolation weight alpha (Figure 6)", "",
                      markdown_table(rows, ["alpha", *b, "avg"]), ""]
        rows = [r for r in tables["speed"] if r["temperature"] == t]
        if rows:
            lines += ["### Wall-clock speed and verification cost", "",
                      "tokens/s over whole generate calls (prefill included) on the questions vanilla also ran.", "",
                      markdown_table(rows, ["strategy", "questions", "tau", "tokens_per_s", "speedup", "tree_size",
                                            "union_size", "draft_ms_per_step", "verify_ms_per_step",
                                            "same_output_as_vanilla"]), ""]
        lines += [f"![{p}](plots/{p})" for p in plots if p.endswith(f"T{t:g}.png")] + [""]
    lines += ["## Claims of the TAPS paper, measured here at T=0", "",
              "Each line: the claim, whether it holds on this run's numbers, and those numbers. How each claim is "
              "checked: docs/DESIGN.md, section \"Claims the report checks\".", ""]
    lines += [claim_line(claim) for claim in tables["claims"]] + [""]
    return "\n".join(lines)


SWEEPS_FILE = "sweeps.json"


def _number(text: str):
    """A CSV cell as a float when it is one (so tables format it), else the text."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def sweep_sections(out: Path, sweeps: list[str]) -> list[str]:
    """Markdown of each sweep folder's ``results.csv`` (evaluated trials) with its plot copied into
    ``out/plots`` as ``sweep-<name>.png``; a folder without results is named as missing."""
    lines = []
    for folder in map(Path, sweeps):
        results = folder / "results.csv"
        lines += [f"## Sweep `{folder.name}` ({folder})", ""]
        if not results.is_file():
            lines += [f"No `results.csv` in {folder}: the sweep has not finished.", ""]
            continue
        with results.open() as f:
            rows = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f) if r.get("objective")]
        if rows:
            keys = [k for k in rows[0] if k in ("alpha", "weights", "ratio", "total")]
            taus = [k for k in rows[0] if k.startswith("tau/")]
            lines += [markdown_table(rows, [*keys, *taus, "objective", "wall_s"]), ""]
        for plot in sorted(folder.glob("*.png")):
            name = f"sweep-{folder.name}-{plot.name}"
            shutil.copyfile(plot, out / "plots" / name)
            lines += [f"![{name}](plots/{name})", ""]
    return lines


def exactness_section(out: Path) -> list[str]:
    """The run's exactness accounting (``exactness.json``, written by ``taps eval``) as markdown lines."""
    from taps_ray.eval.exactness import (  # loads the target model code: only when a run has exactness
        EXACTNESS_FILE,
        Divergence,
        ExactnessReport,
    )

    path = out / EXACTNESS_FILE
    if not path.is_file():
        return []
    raw = json.loads(path.read_text())
    report = ExactnessReport(dtype=raw["dtype"], prompts=raw["prompts"], identical=raw["identical"],
                             divergences=[Divergence(**d) for d in raw["divergences"]],
                             max_logit_error=raw["max_logit_error"])
    return ["", "## Exactness (T = 0, each greedy turn against same-dtype vanilla)", "", report.to_markdown(), ""]


def write_report(out: str | Path, sweeps: list[str | Path] | None = None) -> Path:
    """Regenerate ``report.md``, ``tables/*.csv``, ``plots/*.png`` and ``summary.json`` in ``out`` from its
    records; returns the path of ``report.md``. ``sweeps``: sweep folders (``taps sweep`` outputs) whose
    results and plots the report includes; they are remembered in ``out/sweeps.json`` for later
    regenerations. FileNotFoundError when ``out`` has no records."""
    out = Path(out)
    records = read_records(out / RECORDS)
    if not records:
        raise FileNotFoundError(f"{out / RECORDS} has no records: run `taps eval` into {out} first")
    run = json.loads((out / RUN_FILE).read_text()) if (out / RUN_FILE).is_file() else {}
    tables, data = build_tables(records)
    (out / "tables").mkdir(exist_ok=True)
    (out / "plots").mkdir(exist_ok=True)
    names = {"tau": "tau", "routing": "routing", "entropy": "entropy", "depth": "acceptance_by_depth",
             "alpha": "tau_vs_alpha", "speed": "speed", "claims": "claims"}
    for key, name in names.items():
        if tables[key]:
            write_csv(out / "tables" / f"{name}.csv", tables[key])
    plots = _plots(out / "plots", tables, data)
    summary = {"run": run, "records": len(records), "temperatures": data.temperatures, "benchmarks": data.benchmarks,
               "strategies": data.strategies, **tables, "plots": plots}
    write_json(out / "summary.json", _clean(summary))
    if sweeps is not None:
        write_json(out / SWEEPS_FILE, [str(Path(p).resolve()) for p in sweeps])
    remembered = json.loads((out / SWEEPS_FILE).read_text()) if (out / SWEEPS_FILE).is_file() else []
    path = out / "report.md"
    markdown = render_markdown(tables, data, run, plots)
    atomic_write(path, "\n".join([markdown, *exactness_section(out), *sweep_sections(out, remembered)]))
    return path
