"""Training throughput and the price of concurrency: each variant alone, then all of them at once.

    python benchmarks/bench_train.py configs/demo.yaml [--variants eagle2-math,hass-math] \
        [--full-vocab eagle2-math,hass-math] [--out runs/bench/train.json]

Every run trains from scratch (``--force``) into ``runs/bench-train/...`` on the config's cached
features, so it never touches the config's own run. Reports per run: tokens, training tokens/s
per worker (tokens over the loop's own training seconds, held-out evaluation excluded), wall
time (Ray Train start, data ingest, held-out evaluation and checkpoints included) and the overhead:
wall time less the training seconds (what a run costs beyond its optimizer steps). ``--full-vocab
NAMES`` adds alone-runs of those variants without the reduced draft vocabulary (the LM-head lever). The concurrent run's wall time is
compared with the sum of the alone-runs' wall times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def train(cfg, variants: list[str], label: str) -> list[dict]:
    from taps_ray.train.launch import run_training

    run = cfg.model_copy(update={"name": f"bench-train/{label}"})
    summary = run_training(run, variants, mode="force")
    rows = []
    for r in summary.variants:
        m = r.metrics
        rows.append({"run": label, "variant": r.variant, "algorithm": r.algorithm, "status": r.status,
                     "draft_vocab": cfg.drafter.draft_vocab_size, "tokens": r.tokens,
                     "tokens_per_s_per_worker": m["tokens"] / m["train_seconds"] if m.get("train_seconds") else None,
                     "variant_wall_s": r.wall_s, "run_wall_s": summary.wall_s, "sim_tau": m.get("heldout/tau"),
                     "overhead_s": r.wall_s - m["train_seconds"] if m.get("train_seconds") else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="experiment YAML, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=1")
    parser.add_argument("--variants", default=None, help="comma-separated (default: all of the config's)")
    parser.add_argument("--full-vocab", default="", metavar="NAMES",
                        help="comma-separated variants to also train alone with the full vocabulary")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)

    from taps_ray.config import load_config

    cfg = load_config(args.config, args.overrides)
    names = args.variants.split(",") if args.variants else [v.name for v in cfg.variants]
    rows = []
    for name in names:
        rows += train(cfg, [name], f"alone-{name}")
    if args.full_vocab:
        full = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"draft_vocab_size": None})})
        for name in args.full_vocab.split(","):
            rows += train(full, [name], f"alone-{name}-full-vocab")
    concurrent = train(cfg, names, "concurrent") if len(names) > 1 else []
    rows += concurrent

    print("| run | variant | draft vocab | tokens | train tok/s/worker | variant wall s | overhead s | run wall s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = "-" if r["tokens_per_s_per_worker"] is None else f"{r['tokens_per_s_per_worker']:.0f}"
        overhead = "-" if r["overhead_s"] is None else f"{r['overhead_s']:.1f}"
        print(f"| {r['run']} | {r['variant']} | {r['draft_vocab'] or 'full'} | {r['tokens']} | {rate} | "
              f"{r['variant_wall_s']:.0f} | {overhead} | {r['run_wall_s']:.0f} |")
    result = {"config": args.config, "overrides": args.overrides, "runs": rows}
    if concurrent:
        alone = sum(r["run_wall_s"] for r in rows if r["run"] == f"alone-{r['variant']}")
        result["sum_alone_wall_s"], result["concurrent_wall_s"] = alone, concurrent[0]["run_wall_s"]
        print(f"\nconcurrent: {concurrent[0]['run_wall_s']:.0f}s wall for {len(names)} variants; "
              f"one after another: {alone:.0f}s (sum of the alone runs)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
