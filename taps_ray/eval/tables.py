"""The report's tables, computed from evaluation records (:mod:`taps_ray.eval.report` writes them).

Every number comes from ``records.jsonl`` with the metric definitions of :mod:`taps_ray.spec.stats`:
tau = appended tokens / steps over a benchmark's questions (micro; ``tau_q`` is the mean of
per-question tau), the average column is the mean over benchmarks (paper Table 1). Per-depth
acceptance at depth d = accepted / (accepted + rejected) draft tokens at d; steps whose accepted
path ended at a leaf before d tried nothing there and are counted apart (``leaf<d>``), not as
rejections. A question is routed to the drafter that verified most of its steps. Speedup = tokens/s of a
strategy / tokens/s of vanilla on the same questions of the same run.

Records of two methods never mix (:func:`~taps_ray.eval.records.record_method`): every table but speed is
computed from the paper-method records (the paper's fixed trees, no lookup) when the run has any, else
from the production ones; the speed table has rows of both, each against the same vanilla records.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable

import numpy as np

from taps_ray.eval.intervals import LEVEL, mean_tau_interval, speedup_interval, tau_interval
from taps_ray.eval.records import record_method
from taps_ray.spec import stats

METHODS = ("paper", "production")

MATH_BENCHMARKS = ("gsm8k", "math_500", "svamp")
CHAT_BENCHMARKS = ("mt_bench",)
BENCHMARK_ORDER = ("mt_bench", "gsm8k", "math_500", "svamp")


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


def tau_table(data: Records, intervals: bool = True) -> list[dict]:
    """Rows (temperature, strategy): tau per benchmark, their mean ``avg``, per-question means, counts, and
    (``intervals``) each one's bootstrap interval over questions at :data:`~taps_ray.eval.intervals.LEVEL`
    (``<b>_low`` / ``<b>_high``, ``avg_low`` / ``avg_high``)."""
    rows = []
    for t in data.temperatures:
        for s in data.strategies:
            if not data.get(t, s):
                continue
            row = {"temperature": t, "strategy": s}
            groups = [data.get(t, s, b) for b in data.benchmarks]
            for b, group in zip(data.benchmarks, groups):
                row[b] = _tau(group) if group else math.nan
                row[f"{b}_tau_q"] = stats.mean_tau(r["tau"] for r in group)
                row[f"{b}_n"] = len(group)
                if intervals:
                    row[f"{b}_low"], row[f"{b}_high"] = tau_interval(group)
            row["avg"] = _mean(row[b] for b in data.benchmarks)
            if intervals:
                row["avg_low"], row["avg_high"] = mean_tau_interval(groups)
            rows.append(row)
    return rows


def with_interval(row: dict, column: str) -> str:
    """``row[column]`` with its interval, as the report prints a tau cell: ``3.80 [3.41, 4.12]``."""
    value = row.get(column, math.nan)
    if value is None or math.isnan(value):
        return "–"
    low, high = row.get(f"{column}_low", math.nan), row.get(f"{column}_high", math.nan)
    return f"{value:.2f}" if math.isnan(low) else f"{value:.2f} [{low:.2f}, {high:.2f}]"


INTERVAL_NOTE = (f"tau [{LEVEL:.0%} bootstrap interval over the benchmark's questions]; the average's interval resamples "
                 "each benchmark apart")


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
    rejected draft tokens (the first tried child at the first failing depth), and rejected - accepted."""
    rows = []
    for t, s, b, group in speculative_groups(data):
        acc_d = [v for r in group for step in r.get("draft_entropy", []) for v in step if v is not None]
        acc_t = [v for r in group for step in r.get("target_entropy", []) for v in step if v is not None]
        rej_d = [v for r in group for v in r.get("rejected_draft_entropy", []) if v is not None]
        rej_t = [v for r in group for v in r.get("rejected_target_entropy", []) if v is not None]
        rows.append({"temperature": t, "strategy": s, "benchmark": b,
                     "accepted_draft": _mean(acc_d), "rejected_draft": _mean(rej_d),
                     "draft_delta": _mean(rej_d) - _mean(acc_d),
                     "accepted_target": _mean(acc_t), "rejected_target": _mean(rej_t),
                     "target_delta": _mean(rej_t) - _mean(acc_t),
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


def of_method(records: list[dict], method: str) -> list[dict]:
    """The records of ``method``, vanilla's included whatever method it was recorded under."""
    return [r for r in records if r["strategy"] == "vanilla" or record_method(r) == method]


def primary_method(records: list[dict]) -> str:
    """The method the tau, entropy and depth tables use: ``paper`` when the run has paper records."""
    drafting = {record_method(r) for r in records if r["strategy"] != "vanilla"}
    return "paper" if "paper" in drafting or not drafting else "production"


def speed_table(data: Records) -> list[dict]:
    """Rows (temperature, strategy): tokens/s against vanilla on the same questions, speedup (with its
    bootstrap interval over questions, ``speedup_low`` / ``speedup_high``, NaN for vanilla itself), tau,
    verified tree size (and the union before pruning), draft / verify ms per step, share of questions
    whose output equals vanilla's (greedy losslessness, T = 0). Records decoded in a batch (``batched``) have
    no time of their own and no row."""
    rows = []
    for t in data.temperatures:
        vanilla = {(r["benchmark"], str(r["question_id"])): r for r in data.get(t, "vanilla")}
        for s in data.strategies:
            group = [r for r in data.get(t, s) if (r["benchmark"], str(r["question_id"])) in vanilla
                     and r.get("batched", 1) == 1]
            if not group:
                continue
            base = [vanilla[(r["benchmark"], str(r["question_id"]))] for r in group]
            tps = sum(sum(r["new_tokens"]) for r in group) / sum(r["total_s"] for r in group)
            base_tps = sum(sum(r["new_tokens"]) for r in base) / sum(r["total_s"] for r in base)
            steps = sum(r["steps"] for r in group)
            sizes = [x for r in group for x in r["tree_size"]]
            unions = [x for r in group for x in r.get("union_size", r["tree_size"])]
            same = sum(r["output_crc"] == v["output_crc"] for r, v in zip(group, base))
            low, high = (math.nan, math.nan) if s == "vanilla" else _speedup_interval(group, base)
            rows.append({"temperature": t, "strategy": s, "questions": len(group), "tau": _tau(group),
                         "tokens_per_s": tps, "vanilla_tokens_per_s": base_tps, "speedup": tps / base_tps,
                         "speedup_low": low, "speedup_high": high,
                         "tree_size": _mean(sizes), "union_size": _mean(unions),
                         "draft_ms_per_step": 1e3 * sum(r["draft_s"] for r in group) / steps if steps else math.nan,
                         "verify_ms_per_step": 1e3 * sum(r["verify_s"] for r in group) / steps if steps else math.nan,
                         "same_output_as_vanilla": same / len(group) if t == 0 else math.nan})
    return rows


def _speedup_interval(group: list[dict], base: list[dict]) -> tuple[float, float]:
    """The speedup's interval, ``group``'s records paired with vanilla's ``base`` on the same questions."""
    pairs: dict[str, list[list[float]]] = defaultdict(list)
    for r, v in zip(group, base):
        pairs[r["benchmark"]].append([sum(r["new_tokens"]), r["total_s"], sum(v["new_tokens"]), v["total_s"]])
    return speedup_interval([np.asarray(rows, dtype=float) for rows in pairs.values()])


def rows_at(tables: dict, name: str, t: float, pooled: bool = False) -> list[dict]:
    """The rows of table ``name`` at temperature ``t``; ``pooled``: only those over all benchmarks."""
    return [r for r in tables[name] if r["temperature"] == t and (not pooled or r["benchmark"] == "all")]


def compute_tables(records: list[dict]) -> tuple[dict, Records]:
    """Every table of the report (``tau``, ``routing``, ``entropy``, ``depth``, ``alpha``, ``speed``) and the
    grouped records; :func:`taps_ray.eval.report.build_tables` adds the claims."""
    data = Records(of_method(records, primary_method(records)))
    speed = [{**row, "method": method} for method in METHODS
             for row in speed_table(Records(of_method(records, method)))
             if row["strategy"] != "vanilla" or method == primary_method(records)]
    tables = {"tau": tau_table(data), "routing": routing_table(data), "entropy": entropy_table(data),
              "depth": depth_table(data), "alpha": alpha_table(data), "speed": speed,
              "cost_models": sorted({r["cost_model"] for r in records if r.get("cost_model")})}
    return tables, data
