"""At each divergence of a ``taps bench`` report, the rounding error of the two tokens' logits at that position.

    python benchmarks/divergence_errors.py runs/bench/bench.json [--config configs/demo.yaml]

``taps bench`` calls a divergence from same-dtype vanilla a tie when the float32 gap between the two tokens is
below the largest |low-precision - float32| logit error over all prompts (:mod:`taps_ray.eval.exactness`). This
measures the tighter, per-position bound issue 26 asks about: for each divergence it re-runs the position
teacher forced on vanilla's prefix and prints the float32 gap, the two logits' errors summed (|err_v| + |err_o|)
on two of the paths a decode takes there -- the wide prefill of the prefix and a one-row step after it -- and
each path's own low-precision gap. The tree step that produced the other token is a third path, not replayed.
The report's prompts are drawn again the way ``taps bench`` draws them (its benchmark, limit and drafter).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a taps bench bench.json with greedy outputs and exactness")
    parser.add_argument("--config", default="configs/demo.yaml", help="the config the bench ran")
    args = parser.parse_args(argv)

    from taps_ray.config import load_config
    from taps_ray.data.contamination import union_trained_prompts
    from taps_ray.drafter_sources import resolve_drafter_dir
    from taps_ray.eval.bench import benchmark_prompts
    from taps_ray.models.target import TargetModel

    report = json.loads(open(args.report).read())
    settings, exactness = report["settings"], report.get("exactness")
    if not exactness or not exactness.get("divergences"):
        print(f"divergence_errors: {args.report} has no divergences to measure", file=sys.stderr)
        return 2
    cfg = load_config(args.config)
    target = TargetModel.load(cfg.target)
    reference = TargetModel.load(cfg.target.model_copy(update={"dtype": "float32", "weights": "dense"}))
    drafter = settings["drafter"]
    seen = union_trained_prompts([resolve_drafter_dir(drafter)]) if not drafter.startswith("untrained") else set()
    prompts = benchmark_prompts(target, settings["benchmark"], settings["prompts"], exclude=seen)
    vanilla = report["outputs"]["vanilla"]
    print(f"{target.precision} against float32, {settings['machine']}")
    print("| method | prompt | position | fp32 logit | fp32 gap | wide prefill: error sum, its gap | one-row step: error "
          "sum, its gap |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for div in exactness["divergences"]:
            i, pos, v, o = div["prompt"], div["position"], div["vanilla_token"], div["other_token"]
            ids = torch.cat([prompts[i], torch.tensor(vanilla[i][:pos], dtype=torch.long)])
            exact = reference.prefill(ids[None]).logits[0, -1].float()
            wide = target.prefill(ids[None]).logits[0, -1].float()
            cache = target.new_cache(ids.numel())
            target.prefill(ids[None, :-1], cache)
            last = torch.tensor([[ids.numel() - 1]])
            one = target.logits(target.forward_hidden(ids[None, -1:], last, cache, None))[0, -1].float()
            cells = [f"{float(exact[v]):.2f}", f"{float(exact[v] - exact[o]):+.4f}"]
            for logits in (wide, one):
                error = float((logits[v] - exact[v]).abs() + (logits[o] - exact[o]).abs())
                cells.append(f"{error:.4f}, {float(logits[v] - logits[o]):+.4f}")
            print(f"| {div['method']} | {i} | {pos} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
