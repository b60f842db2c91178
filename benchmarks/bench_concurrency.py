"""Throughput under load: output tok/s and latency at several concurrencies, vanilla and speculative,
with batched verification on and off, in one run.

    python benchmarks/bench_concurrency.py configs/demo.yaml [overrides ...] \
        [--concurrency 1,4,8,16] [--strategies vanilla,single] [--modes batched,unbatched] \
        [--requests-per-client 2] [--max-tokens 64] [--prompts gsm8k:24,mt_bench:24] \
        [--out runs/bench/concurrency.json] [--plot docs/img/concurrency.png]

For each mode the Serve application of the config is deployed in-process (``unbatched``:
``serve.batching.max_requests=1`` and ``serve.batching.max_tokens=0``, each request verified alone with
its whole tree; ``batched``: the config's own batching), warmed up, and then, for each strategy and
concurrency C, ``benchmarks/load_test.py`` sends ``max(4, C * requests-per-client)`` greedy streaming
chat requests from C clients, cycling through the prompt set (``--prompts``: ``load-test``, the load
test's 12 assorted prompts, or ``BENCHMARK:N,...``, N seeded first-turn questions of each benchmark,
interleaved). Recorded per point: aggregate output tok/s, p50/p95 request latency,
mean acceptance length, steps whose tree was cut to its load share, the Verifier's target forwards per
batch size, errors, and whether every text equals in-process vanilla greedy. The ratio ``C=8 / C=1`` and ``speculative / vanilla`` per
concurrency are printed and written; ``--plot`` draws tok/s against concurrency.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_test import PROMPTS, verify  # noqa: E402
from load_test import run as run_load  # noqa: E402

UNBATCHED = ["serve.batching.max_requests=1", "serve.batching.max_tokens=0"]


def prompt_texts(spec: str) -> list[str]:
    """The prompt set of ``--prompts`` (see the module docs)."""
    if spec == "load-test":
        return list(PROMPTS)
    from taps_ray.data.benchmarks import load_benchmark

    groups = []
    for part in spec.split(","):
        name, _, count = part.partition(":")
        groups.append([q.turns[0] for q in load_benchmark(name, int(count) if count else None)])
    return [text for row in zip(*groups) for text in row]


def point(url: str, strategy: str, concurrency: int, requests: int, max_tokens: int, prompts: list[str]) -> dict:
    """One load run: ``requests`` greedy requests from ``concurrency`` clients with ``strategy``."""
    load = argparse.Namespace(url=url, model=None, strategy=strategy, concurrency=concurrency, requests=requests,
                              duration=None, max_tokens=max_tokens, temperature=0.0, seed=None, timeout=900.0,
                              verbose=False, verify=None, hangup_fraction=0.0, prompt_texts=prompts)
    out = run_load(load)
    s = out["summary"]
    shrunk = sum(r["taps"].get("shrunk_steps", 0) for r in out["records"] if r["ok"])
    steps = sum(r["taps"].get("steps", 0) for r in out["records"] if r["ok"])
    return {"strategy": strategy, "concurrency": concurrency, "requests": s["requests"], "ok": s["ok"],
            "errors": s["errors"], "refused_429": s["refused_429"], "wall_s": round(s["wall_s"], 2),
            "output_tokens": s["completion_tokens"], "tokens_per_s": round(s["output_tokens_per_s"], 2),
            "latency_p50_s": round(s["latency_s"]["p50"], 2), "latency_p95_s": round(s["latency_s"]["p95"], 2),
            "tau": None if s["tau"] is None else round(s["tau"], 2), "steps": steps, "shrunk_steps": shrunk,
            "records": out["records"]}


def batches(cfg) -> dict[int, int]:
    """The Verifier's target forwards so far, per number of requests they verified."""
    from ray import serve

    info = serve.get_deployment_handle("Verifier", cfg.serve.app_name).info.remote().result()
    return {int(size): count for size, count in info["batches"].items()}


def run_mode(config: str, overrides: list[str], mode: str, args) -> list[dict]:
    from ray import serve

    from taps_ray.config import load_config
    from taps_ray.serving.app import run as serve_app

    cfg = load_config(config, overrides + (UNBATCHED if mode == "unbatched" else []))
    url = serve_app(cfg, blocking=False)
    try:
        for strategy in args.strategies:
            point(url, strategy, 1, 1, 8, args.prompt_texts)
        points = []
        for strategy in args.strategies:
            for c in args.concurrency:
                before = batches(cfg)
                p = point(url, strategy, c, max(4, c * args.requests_per_client), args.max_tokens, args.prompt_texts)
                after = batches(cfg)
                p["mode"] = mode
                p["batch_sizes"] = {size: after.get(size, 0) - before.get(size, 0) for size in sorted(after)
                                    if after.get(size, 0) > before.get(size, 0)}
                points.append(p)
                print(f"{mode:9s} {strategy:8s} C={c:2d}: {p['tokens_per_s']:7.2f} tok/s  p50 {p['latency_p50_s']:6.2f}s"
                      f"  p95 {p['latency_p95_s']:6.2f}s  tau {p['tau']}  shrunk {p['shrunk_steps']}/{p['steps']}"
                      f"  errors {p['errors']}  batches {p['batch_sizes']}", flush=True)
        return points
    finally:
        serve.delete(cfg.serve.app_name)


def ratios(points: list[dict]) -> dict:
    """Per mode and strategy, C / C=1 tok/s; per mode and concurrency, each strategy's tok/s over vanilla's."""
    by = {(p["mode"], p["strategy"], p["concurrency"]): p["tokens_per_s"] for p in points}
    out: dict = {"scaling": {}, "over_vanilla": {}}
    for (mode, strategy, c), value in by.items():
        single = by.get((mode, strategy, 1))
        if single:
            out["scaling"][f"{mode}/{strategy}/C={c}"] = round(value / single, 2)
        vanilla = by.get((mode, "vanilla", c))
        if vanilla and strategy != "vanilla":
            out["over_vanilla"][f"{mode}/{strategy}/C={c}"] = round(value / vanilla, 2)
    return out


def plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in sorted({p["mode"] for p in points}):
        for strategy in sorted({p["strategy"] for p in points}):
            line = sorted((p["concurrency"], p["tokens_per_s"]) for p in points
                          if p["mode"] == mode and p["strategy"] == strategy)
            if line:
                ax.plot(*zip(*line), marker="o", linestyle="-" if mode == "batched" else "--",
                        label=f"{strategy}, {mode}")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate output tokens / s")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="experiment YAML, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. serve.batching.max_tokens=32")
    parser.add_argument("--concurrency", default="1,4,8,16", help="comma-separated client counts")
    parser.add_argument("--strategies", default="vanilla,single", help="comma-separated taps strategies")
    parser.add_argument("--modes", default="batched,unbatched", help="batched, unbatched or both")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="load-test", help="load-test, or BENCHMARK:N,... (e.g. gsm8k:24,mt_bench:24)")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--plot", default=None, help="PNG of tok/s against concurrency")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    args.strategies = args.strategies.split(",")
    modes = args.modes.split(",")
    if min(args.concurrency) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        parser.error("--concurrency values, --requests-per-client and --max-tokens must be >= 1")
    if not set(modes) <= {"batched", "unbatched"}:
        parser.error(f"--modes takes batched and/or unbatched, got {args.modes!r}")

    try:
        args.prompt_texts = prompt_texts(args.prompts)
    except ValueError as err:
        parser.error(f"--prompts {args.prompts!r}: {err}")
    start = time.time()
    points = [p for mode in modes for p in run_mode(args.config, args.overrides, mode, args)]
    from ray import serve

    serve.shutdown()
    records = [r for p in points for r in p["records"] if r["ok"]]
    check = verify(args.config, [argparse.Namespace(**r) for r in records], args.max_tokens, overrides=args.overrides,
                   prompts=args.prompt_texts)
    summary = {"config": args.config, "overrides": args.overrides, "max_tokens": args.max_tokens,
               "prompts": args.prompts,
               "requests_per_client": args.requests_per_client, "seconds": round(time.time() - start),
               "ratios": ratios(points), "identical_to_vanilla_greedy": {k: v for k, v in check.items()
                                                                          if k != "mismatched"},
               "mismatched": len(check["mismatched"]),
               "points": [{k: v for k, v in p.items() if k != "records"} for p in points]}
    print(json.dumps({k: summary[k] for k in ("ratios", "identical_to_vanilla_greedy", "mismatched")}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**summary, "records": records}, indent=1))
    if args.plot:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
