"""What one ``taps train`` run costs beyond its optimizer steps, on a tiny synthetic experiment.

    python benchmarks/bench_train_overhead.py [--runs 2] [--out runs/bench/train_overhead.json]

Builds the test suite's tiny target and feature sets (``tests/train/train_helpers.py``: a 2-layer
random Llama, 36 math and 36 chat rows, one EAGLE-2 variant of 12 steps) in a temporary folder,
starts a local Ray cluster and trains the variant ``--runs`` times (``--force``). Per run: wall time
of ``run_training``, seconds until the worker finished its setup (Ray Train controller and worker
started, drafter built), until the first logged step (data read), the loop's own training seconds,
and the overhead (wall less training seconds). The first run also pays for Ray's worker pool.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="train-overhead-"))
    os.environ["TAPS_CACHE"] = str(tmp / "cache")
    from taps_ray.config import load_config
    from taps_ray.runtime.cluster import init_ray
    from taps_ray.train.launch import run_training
    from tests.train.train_helpers import tiny_experiment

    path, _ = tiny_experiment(tmp, [{"name": "a", "algorithm": "eagle2", "mixture": "math-only"}])
    init_ray()
    rows = []
    for run in range(args.runs):
        cfg = load_config(path)
        started = time.time()
        summary = run_training(cfg, mode="force")
        wall = time.time() - started
        (result,) = summary.variants
        folder = cfg.run_dir / "drafters" / "a"
        meta = json.loads((folder / "config.json").read_text())
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        first_log = min(r["time"] for r in records if r["kind"] == "train")
        train_s = float(result.metrics.get("train_seconds", 0.0))
        rows.append({"run": run + 1, "status": result.status, "steps": int(result.metrics.get("step", 0)),
                     "wall_s": wall, "worker_ready_s": meta["training"]["attempts"][0]["time"] - started,
                     "first_log_s": first_log - started, "train_s": train_s, "overhead_s": wall - train_s})
    print("| run | steps | wall s | worker ready s | first logged step s | training s | overhead s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['steps']} | {r['wall_s']:.1f} | {r['worker_ready_s']:.1f} | {r['first_log_s']:.1f} | "
              f"{r['train_s']:.2f} | {r['overhead_s']:.1f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"runs": rows}, indent=1))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
