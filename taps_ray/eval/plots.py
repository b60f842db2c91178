"""The report's plots (``plots/*.png``): tau by strategy, acceptance by depth, tau vs alpha, speedup.

matplotlib is imported inside :func:`draw_plots`: only when plots are drawn, the tables need none of it.
"""

from __future__ import annotations

import math
from pathlib import Path

from taps_ray.eval.tables import Records


def draw_plots(out: Path, tables: dict, data: Records) -> list[str]:
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
    import matplotlib.pyplot as plt  # loaded by draw_plots, which calls this

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name

