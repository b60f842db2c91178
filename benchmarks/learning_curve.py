"""Held-out tau of drafters trained on more or fewer rows: the learning curve of a recipe.

    python benchmarks/learning_curve.py configs/release.yaml \
        --drafter runs/release/drafters/eagle2-math-300 --drafter runs/release/drafters/eagle2-math-1000 \
        --drafter runs/release/drafters/eagle2-math --benchmark gsm8k --benchmark mt_bench \
        --limit 10 --max-new-tokens 128 --out runs/release/learning-curve

For each drafter: its training rows, epochs and tokens (from its ``variant.json`` and training
record), and greedy tau with the config's tree on each benchmark (questions it trained on
excluded, same seeded draw for every drafter). Writes ``learning_curve.json``, ``.md`` and a
``.png`` plot (tau vs training rows, one line per benchmark) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from taps_ray.config import load_config
from taps_ray.data.contamination import union_trained_prompts
from taps_ray.eval.bench import drafter_tau
from taps_ray.models.drafter import DraftHead, read_drafter_meta
from taps_ray.models.target import TargetModel


def training_summary(folder: Path) -> dict:
    """Rows, epochs and tokens a drafter folder says it trained on."""
    variant = json.loads((folder / "variant.json").read_text()) if (folder / "variant.json").is_file() else {}
    training = read_drafter_meta(folder).get("training", {})
    counts = (variant.get("mixture") or {}).get("counts") or {}
    return {"drafter": folder.name, "rows": int(sum(counts.values())) if counts else None,
            "epochs": (variant.get("train") or {}).get("epochs", training.get("epochs")),
            "tokens": training.get("tokens"), "train_seconds": training.get("train_seconds")}


def to_markdown(rows: list[dict], benchmarks: list[str], settings: dict) -> str:
    head = "| drafter | training rows | epochs | " + " | ".join(f"tau {b}" for b in benchmarks) + " |"
    lines = [f"Tree {settings['tree']}, {settings['limit']} questions x {settings['max_new_tokens']} new tokens, greedy.",
             "", head, "|---|---:|---:|" + "---:|" * len(benchmarks)]
    for row in rows:
        taus = " | ".join(f"{row['tau'][b]:.2f}" for b in benchmarks)
        lines.append(f"| {row['drafter']} | {row['rows']} | {row['epochs']} | {taus} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], benchmarks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ordered = sorted((r for r in rows if r["rows"]), key=lambda r: r["rows"])
    for bench in benchmarks:
        ax.plot([r["rows"] for r in ordered], [r["tau"][bench] for r in ordered], marker="o", label=bench)
    ax.set_xscale("log")
    ax.set_xlabel("training rows (self-distilled)")
    ax.set_ylabel("held-out tau")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--drafter", action="append", required=True, help="trained drafter folder (repeat)")
    parser.add_argument("--benchmark", action="append", default=None, help="held-out benchmark(s), default gsm8k")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    benchmarks = args.benchmark or ["gsm8k"]
    target = TargetModel.load(cfg.target)
    folders = [Path(d) for d in args.drafter]
    seen = union_trained_prompts(folders)
    rows = []
    for folder in folders:
        drafter = DraftHead.load(folder, target.config, target.fingerprint, target.device, target.dtype)
        row = training_summary(folder)
        results = [drafter_tau(target, drafter, cfg.tree, b, args.limit, args.max_new_tokens, seen)
                   for b in benchmarks]
        row["tau"] = {r["benchmark"]: r["tau"] for r in results}
        row["questions"] = {r["benchmark"]: r["questions"] for r in results}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"tree": cfg.tree.model_dump(), "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                "dtype": target.describe()["dtype"], "command": " ".join(sys.argv)}
    (out / "learning_curve.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    (out / "learning_curve.md").write_text(to_markdown(rows, benchmarks, settings))
    plot(rows, benchmarks, out / "learning_curve.png")
    print(to_markdown(rows, benchmarks, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
