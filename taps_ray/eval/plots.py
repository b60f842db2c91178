"""The report's plots (``plots/*.png``): tau by strategy, acceptance by depth, tau vs alpha, speedup.

matplotlib is imported inside :func:`draw_plots`: only when plots are drawn, the tables need none of it.
"""

from __future__ import annotations

import math
from pathlib import Path

from taps_ray.eval.intervals import LEVEL
from taps_ray.eval.tables import Records, rows_at


def draw_plots(out: Path, tables: dict, data: Records) -> list[str]:
    import matplotlib  # only when plots are drawn: the tables need none of it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for t in data.temperatures:
        label = f"T{t:g}"
        rows = [r for r in rows_at(tables, "tau", t) if r["strategy"] != "vanilla"]
        if rows:
            fig, ax = plt.subplots(figsize=_bar_chart_size(rows))
            errors = [[max(r["avg"] - r.get("avg_low", r["avg"]), 0) for r in rows][::-1],
                      [max(r.get("avg_high", r["avg"]) - r["avg"], 0) for r in rows][::-1]]
            errors = [[0.0 if math.isnan(e) else e for e in side] for side in errors]
            ax.barh([r["strategy"] for r in rows][::-1], [r["avg"] for r in rows][::-1], xerr=errors, capsize=3,
                    color="#4878a8", ecolor="#333333")
            written.append(_save(fig, ax, out / f"tau_{label}.png", f"average tau (tokens per target step), "
                                 f"{LEVEL:.0%} bootstrap interval", f"Acceptance length by strategy, T={t:g}"))
        rows = rows_at(tables, "depth", t, pooled=True)
        if rows:
            fig, ax = plt.subplots(figsize=(6, 4))
            for r in rows:
                depths = sorted(int(k[1:]) for k in r if k.startswith("d") and k[1:].isdigit())
                ax.plot(depths, [r[f"d{d}"] for d in depths], marker="o", label=r["strategy"])
            ax.set_ylim(0, 1.02)
            written.append(_save(fig, ax, out / f"acceptance_by_depth_{label}.png", "draft depth",
                                 f"Acceptance rate by depth, T={t:g}", ylabel="acceptance rate"))
        rows = rows_at(tables, "alpha", t)
        if rows:
            fig, ax = plt.subplots(figsize=(6, 4))
            alphas = [r["alpha"] for r in rows]
            for b in [*data.benchmarks, "avg"]:
                ax.plot(alphas, [r.get(b, math.nan) for r in rows], marker="o", label=b,
                        linewidth=2.5 if b == "avg" else 1.2)
            written.append(_save(fig, ax, out / f"tau_vs_alpha_{label}.png", "alpha (weight of the first drafter)",
                                 f"Weight averaging: tau vs alpha, T={t:g}", ylabel="tau"))
        rows = rows_at(tables, "speed", t)
        if rows:
            fig, ax = plt.subplots(figsize=_bar_chart_size(rows))
            methods = {r.get("method", "paper") for r in rows if r["strategy"] != "vanilla"}
            names = [r["strategy"] if len(methods) < 2 or r["strategy"] == "vanilla"
                     else f"{r['strategy']} ({r['method']})" for r in rows]
            colors = ["#3f7fbf" if r.get("method") == "production" else "#6a9f58" for r in rows]
            ax.barh(names[::-1], [r["speedup"] for r in rows][::-1], color=colors[::-1])
            ax.axvline(1.0, color="gray", linestyle="--")
            written.append(_save(fig, ax, out / f"speedup_{label}.png",
                                 "speedup vs vanilla (tokens/s ratio, same prompts)", f"Wall-clock speedup, T={t:g}"))
    return written


def _bar_chart_size(rows: list[dict]) -> tuple[float, float]:
    """A horizontal bar chart's size: one bar per row."""
    return 7, 0.35 * len(rows) + 1.5


def _save(fig, ax, path: Path, xlabel: str, title: str, ylabel: str | None = None) -> str:
    """Label ``ax`` (a legend when it has labelled lines), write ``fig`` to ``path`` and close it; the
    file's name."""
    import matplotlib.pyplot as plt  # loaded by draw_plots, which calls this

    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
