"""Feature-extraction throughput: `taps prepare` (Ray Data target actors) into a fresh cache.

Usage: python benchmarks/bench_features.py configs/demo.yaml [--dataset math] [--limit 64] [--layers last|eagle3]
[--out FILE]
Prints tokens/s of the teacher-forced target pass (including tokenization and Parquet writing) and the set's disk
size per token (``--layers eagle3``: the three EAGLE-3 layers and the last hidden state per token).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch

from taps_ray.config import load_config
from taps_ray.data import feature_sets, features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--dataset", default="math")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--layers", choices=("last", "eagle3"), default="last")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = load_config(args.config, [f"data.features.layers={args.layers}"])
    for alt in cfg.data.datasets[args.dataset].alternatives:
        alt.limit = args.limit
    with tempfile.TemporaryDirectory() as tmp:
        feature_sets.features_root = lambda: Path(tmp)
        result = features.prepare_features(cfg, [args.dataset])[0]
    record = {
        **result.to_dict(),
        "layers": args.layers,
        "bytes_per_token": round(result.megabytes * 2**20 / result.tokens),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "max_len": cfg.data.features.max_len,
    }
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
