"""A sweep's results: one row per trial, the best trial, ``results.csv``, the plot, ``best.json`` and
the printed table."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taps_ray.runstate import atomic_write, write_json
from taps_ray.sweeps.config import SweepSpec
from taps_ray.sweeps.trial import count_attempts

RESULTS = "results.csv"
BEST = "best.json"


@dataclass
class TrialRow:
    """One trial of a finished (or interrupted) sweep."""

    trial_id: str
    status: str
    config: dict[str, Any]
    metrics: dict[str, Any]
    attempts: int
    error: str | None = None

    @property
    def objective(self) -> float:
        value = self.metrics.get("objective")
        return math.nan if value is None else float(value)


@dataclass
class SweepSummary:
    """Everything ``taps sweep`` prints and writes."""

    name: str
    kind: str
    out: Path
    objective: str
    domains: list[str]
    keys: list[str]
    rows: list[TrialRow]
    wall_s: float
    expected: int = 0
    best: TrialRow | None = None
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def failed(self) -> list[TrialRow]:
        return [r for r in self.rows if r.status == "failed"]

    @property
    def unfinished(self) -> int:
        """Trials that did not finish: interrupted ones and those never started."""
        return sum(r.status == "unfinished" for r in self.rows) + max(0, self.expected - len(self.rows))


def describe_config(config: dict) -> str:
    return " ".join(f"{k}={short(v)}" for k, v in config.items())


def short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ",".join(short(v) for v in value) + "]"
    return str(value)



def collect_rows(grid, statuses: dict[str, str], out: Path) -> list[TrialRow]:
    """One :class:`TrialRow` per trial of a Tune ``ResultGrid`` (``statuses``: trial id -> saved Tune
    status): ``ok`` (evaluated), ``stopped`` (stopped early by the scheduler), ``failed`` (after its
    retries) or ``unfinished`` (interrupted)."""
    rows = []
    for result in grid:
        trial_id = Path(result.path).name
        metrics = {k: v for k, v in (result.metrics or {}).items() if not isinstance(v, dict)}
        if result.error is not None:
            status, error = "failed", _error_line(result.error)
        elif metrics.get("evaluated"):
            status, error = "ok", None
        elif statuses.get(trial_id) == "TERMINATED":
            status, error = "stopped", None
        else:
            status, error = "unfinished", None
        config = {k: v for k, v in (result.config or {}).items()}
        rows.append(TrialRow(trial_id, status, config, metrics, count_attempts(out / "trials" / trial_id), error))
    return sorted(rows, key=lambda r: (json.dumps(r.config, sort_keys=True, default=str), r.trial_id))


def discard_stopped_drafters(rows: list[TrialRow], out: Path) -> None:
    """Remove the ``drafter`` folder of every trial the scheduler stopped: a trial whose training finished
    before the stop reached it wrote one that was never evaluated, so it is not a result."""
    for row in rows:
        if row.status == "stopped":
            shutil.rmtree(out / "trials" / row.trial_id / "drafter", ignore_errors=True)


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    cause = [line for line in text if "Error" in line or "Failure" in line]
    return (cause[-1] if cause else (text[-1] if text else type(error).__name__)).strip()[:200]


def best_row(rows: list[TrialRow]) -> TrialRow | None:
    """The evaluated trial with the highest objective (the first of equals)."""
    scored = [r for r in rows if r.status == "ok" and not math.isnan(r.objective)]
    return max(scored, key=lambda r: r.objective) if scored else None


def _columns(summary: SweepSummary) -> list[str]:
    cols = ["trial_id", "status", *summary.keys]
    if summary.kind == "mixture":
        cols += ["mixture", "rows"]
    cols += [f"tau/{d}" for d in summary.domains] + ["objective"]
    if summary.kind == "mixture":
        cols += [f"sim_tau/{d}" for d in summary.domains] + ["sim_objective", "epoch"]
    return cols + ["wall_s", "attempts", "drafter", "error"]


def _cell(row: TrialRow, column: str) -> Any:
    if column in ("trial_id", "status", "attempts", "error"):
        return getattr(row, column)
    if column in row.config:
        return row.config[column]
    return row.metrics.get(column)


def write_outputs(summary: SweepSummary, spec: SweepSpec) -> None:
    """``results.csv``, the plot and ``best.json`` into ``summary.out``."""
    columns = _columns(summary)
    path = summary.out / RESULTS
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(columns)
    for row in summary.rows:
        writer.writerow(["" if (v := _cell(row, c)) is None else json.dumps(v) if isinstance(v, list) else v
                         for c in columns])
    atomic_write(path, table.getvalue())
    summary.files["results"] = path
    plot = plot_results(summary, spec)
    if plot is not None:
        summary.files["plot"] = plot
    best = summary.best
    payload = None if best is None else {
        "trial_id": best.trial_id, "config": best.config, "objective": best.objective,
        "objective_kind": summary.objective, "tau": {d: best.metrics.get(f"tau/{d}") for d in summary.domains},
        "drafter": best.metrics.get("drafter"), "mixture": best.metrics.get("mixture")}
    write_json(summary.out / BEST, payload, default=str)
    summary.files["best"] = summary.out / BEST


def plot_results(summary: SweepSummary, spec: SweepSpec) -> Path | None:
    """Tau per domain (and the objective) of the evaluated trials against ``ratio`` or ``alpha``
    (against the trial otherwise); None when no trial was evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary.rows if r.status == "ok"]
    if not rows:
        return None
    key = next((k for k in ("ratio", "alpha") if k in summary.keys), None)
    if key is not None:
        rows = sorted(rows, key=lambda r: float(r.config[key]))
        xs = [float(r.config[key]) for r in rows]
    else:
        xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for domain in summary.domains:
        ax.plot(xs, [r.metrics.get(f"tau/{domain}", math.nan) for r in rows], "o-", label=f"tau {domain}")
    ax.plot(xs, [r.objective for r in rows], "k--", label=f"objective ({summary.objective})")
    if key == "ratio":
        first, second = spec.mixture.datasets
        ax.set_xlabel(f"share of {first} in the mixture ({first}:{second} = r:1-r)")
        name = "tau_vs_ratio.png"
    elif key == "alpha":
        first, second = list(spec.drafters)
        ax.set_xlabel(f"alpha (alpha * {first} + (1 - alpha) * {second})")
        name = "tau_vs_alpha.png"
    else:
        ax.set_xticks(xs, [describe_config(r.config) for r in rows], rotation=30, ha="right", fontsize=7)
        name = "tau_per_trial.png"
    ax.set_ylabel("tau (acceptance length)")
    ax.set_title(f"{summary.name}: tau per domain on held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = summary.out / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def results_table(summary: SweepSummary) -> str:
    """Markdown table: config, per-domain tau, objective, wall time and status of every trial."""
    head = ["trial", *summary.keys] + (["mixture"] if summary.kind == "mixture" else [])
    head += [f"tau {d}" for d in summary.domains] + ["objective"]
    head += (["sim. objective", "epochs"] if summary.kind == "mixture" else []) + ["wall s", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(value, fmt: str = ".3f") -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(value, fmt)

    for r in summary.rows:
        m = r.metrics
        status = r.status if r.attempts <= 1 else f"{r.status} ({r.attempts} attempts)"
        if r.error:
            status += f": {r.error[:80]}"
        cells = [r.trial_id, *(short(r.config.get(k)) for k in summary.keys)]
        cells += [str(m.get("mixture", "-"))] if summary.kind == "mixture" else []
        cells += [num(m.get(f"tau/{d}")) for d in summary.domains] + [num(m.get("objective"))]
        if summary.kind == "mixture":
            cells += [num(m.get("sim_objective")), str(m.get("epoch", "-"))]
        cells += [num(m.get("wall_s", m.get("time_total_s")), ".0f"), status]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(summary: SweepSummary) -> str:
    """The table, the best config and where everything was written."""
    lines = [results_table(summary), ""]
    if summary.best is not None:
        best = summary.best
        taus = ", ".join(f"{d} {best.metrics.get(f'tau/{d}', math.nan):.3f}" for d in summary.domains)
        lines.append(f"best config: {describe_config(best.config)} (trial {best.trial_id}): {summary.objective} "
                     f"{best.objective:.3f} (tau {taus})")
        lines.append(f"best drafter: {best.metrics.get('drafter')}")
    else:
        lines.append("best config: none (no trial was evaluated)")
    if summary.failed:
        lines.append(f"{len(summary.failed)} trial(s) failed after their retries: "
                     + ", ".join(r.trial_id for r in summary.failed))
    if summary.unfinished:
        lines.append(f"interrupted: {summary.unfinished} of {max(summary.expected, len(summary.rows))} trial(s) did not "
                     f"finish; continue with: taps sweep ... --resume --out {summary.out}")
    lines.append("wrote " + ", ".join(str(p) for p in summary.files.values()) + f" in {summary.wall_s:.0f}s")
    return "\n".join(lines)
