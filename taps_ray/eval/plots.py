"""The report's plots (``plots/*.png``): tau by strategy (with intervals), acceptance by depth, the entropy of
accepted and rejected tokens (the paper's Figure 7), the acceptance grid of strategy x depth per benchmark
(Figure 8), tau vs alpha, speedup.

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
        rows = rows_at(tables, "entropy", t, pooled=True)
        if rows:
            written.append(_entropy_plot(plt, rows, out / f"entropy_{label}.png", t))
        rows = [r for r in rows_at(tables, "depth", t) if r["benchmark"] != "all"]
        if rows:
            written.append(_depth_grid(plt, rows, data.benchmarks, out / f"depth_grid_{label}.png", t))
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


def _entropy_plot(plt, rows: list[dict], path: Path, t: float) -> str:
    """Figure 7: per strategy, the mean draft and verifier entropy at accepted and at rejected tokens."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.35 * len(rows) + 1.8), sharey=True)
    names = [r["strategy"] for r in rows][::-1]
    positions = range(len(names))
    for ax, kind in zip(axes, ("draft", "target")):
        for offset, (outcome, color) in enumerate((("accepted", "#6a9f58"), ("rejected", "#c0504d"))):
            values = [r[f"{outcome}_{kind}"] for r in rows][::-1]
            ax.barh([p + 0.4 * offset - 0.2 for p in positions], [0 if math.isnan(v) else v for v in values],
                    height=0.4, color=color, label=outcome)
        ax.set_yticks(list(positions), names)
        ax.set_title(f"{'draft' if kind == 'draft' else 'verifier'} entropy", fontsize=9)
        ax.set_xlabel("entropy (nats)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", fontsize=7)
    fig.suptitle(f"Entropy at accepted and rejected draft tokens, T={t:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _depth_grid(plt, rows: list[dict], benchmarks: list[str], path: Path, t: float) -> str:
    """Figure 8: per benchmark, acceptance at each depth (columns) for each strategy (rows), as a heat map."""
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    depths = max(int(k[1:]) for r in rows for k in r if k.startswith("d") and k[1:].isdigit())
    shown = [b for b in benchmarks if any(r["benchmark"] == b for r in rows)]
    fig, axes = plt.subplots(1, len(shown), figsize=(2.2 * len(shown) + 2.5, 0.35 * len(strategies) + 1.8),
                             sharey=True, squeeze=False)
    for ax, bench in zip(axes[0], shown):
        by = {r["strategy"]: r for r in rows if r["benchmark"] == bench}
        grid = [[by.get(s, {}).get(f"d{d}", math.nan) for d in range(1, depths + 1)] for s in strategies]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(depths), [str(d) for d in range(1, depths + 1)])
        ax.set_yticks(range(len(strategies)), strategies)
        ax.set_title(bench, fontsize=9)
        ax.set_xlabel("depth")
    fig.colorbar(image, ax=axes[0].tolist(), label="acceptance rate")
    fig.suptitle(f"Acceptance by depth per benchmark, T={t:g}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path.name


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
