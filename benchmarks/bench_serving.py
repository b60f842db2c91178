"""Serving cost and robustness: one command that starts the Serve app in-process and measures it.

    python benchmarks/bench_serving.py configs/demo.yaml \
        'serve.drafters={math: runs/demo/drafters/hass-math, chat: runs/demo/drafters/hass-chat}' \
        --strategy single --prompts 6 --max-tokens 64 \
        [--soak 120 --concurrency 8 --soak-strategy merged:budget --kill-drafter-after 30] \
        [--out runs/bench/serving.json]

1. In-process: the config's target and the strategy's drafters decode ``--prompts`` prompts of
   ``benchmarks/load_test.py`` greedily, one after another (the reference tokens/s).
2. Single stream over HTTP: the same prompts through ``/v1/chat/completions`` (streaming, the
   official ``openai`` client), one request at a time; tokens/s, its ratio to in-process, and
   whether every text equals the in-process one.
3. ``--soak S``: ``--concurrency`` clients for S seconds with ``--soak-strategy`` (default
   ``--strategy``), outputs checked against in-process greedy (the load test); replica RSS
   sampled every 5 s (``memory_mib``: first, last and largest sample per replica); with
   ``--kill-drafter-after T`` one drafter replica is killed T seconds in.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_test import PROMPTS  # noqa: E402
from load_test import run as run_load  # noqa: E402


def in_process(cfg, strategy: str, prompts: list[str], max_tokens: int) -> dict:
    """Greedy decoding of ``prompts`` with ``strategy`` over the config's served drafters, in this process."""
    from taps_ray.models.drafter import DraftHead
    from taps_ray.models.target import TargetModel
    from taps_ray.serving.plan import resolve_plan
    from taps_ray.spec.compose import build_strategy
    from taps_ray.spec.decoder import generate

    target = TargetModel.load(cfg.target)
    plan = resolve_plan(strategy, None, cfg.serve)
    heads = {}
    for name in plan.drafters:
        d = cfg.serve.drafters[name]
        heads[name] = (DraftHead.load(d.checkpoint, target.config, target.fingerprint) if d.checkpoint
                       else DraftHead(target.config, seed=d.seed)).eval()
    decoder = build_strategy(plan.spec, heads, cfg.tree, probe_steps=cfg.serve.route_probe_steps,
                             recheck_every=cfg.serve.route_recheck_every)
    generate(target, [{"role": "user", "content": prompts[0]}], decoder, max_new_tokens=8)
    texts, tokens, seconds, steps = [], 0, 0.0, 0
    for prompt in prompts:
        start = time.perf_counter()
        result = generate(target, [{"role": "user", "content": prompt}], decoder, max_new_tokens=max_tokens)
        seconds += time.perf_counter() - start
        texts.append(result.text)
        tokens += len(result.token_ids)
        steps += len(result.steps)
    return {"texts": texts, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tau": tokens / steps if steps else None}


def replica_rss() -> dict[str, float]:
    """MiB of resident memory per Serve replica process of this machine, keyed ``deployment[pid]``
    (the title's ``.method`` suffix, set while a replica serves a call, is dropped)."""
    import psutil

    sizes = {}
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        title = " ".join(proc.info["cmdline"] or [])
        if title.startswith("ray::ServeReplica:") and proc.info["memory_info"] is not None:
            name = title.split()[0].split(":", 2)[-1].split(".")[0]
            sizes[f"{name}[{proc.pid}]"] = round(proc.info["memory_info"].rss / 2**20, 1)
    return sizes


def kill_one_drafter(after_s: float, killed: list) -> None:
    """After ``after_s`` seconds, ``ray.kill`` the first live drafter replica (named actor in Serve's namespace)."""
    import ray

    time.sleep(after_s)
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if "Drafter_" in actor["name"] and "REPLICA" in actor["name"]:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
            killed.append({"replica": actor["name"], "at_s": after_s})
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="experiment YAML, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. serve.drafters.math=DIR")
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--prompts", type=int, default=6, help=f"single-stream prompts (at most {len(PROMPTS)})")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of concurrent load (0: none)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--soak-strategy", default=None, help="strategy of the soak (default: --strategy)")
    parser.add_argument("--kill-drafter-after", type=float, default=None, metavar="S")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS) or args.max_tokens < 1 or args.concurrency < 1 or args.soak < 0:
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}; --max-tokens, --concurrency > 0; --soak >= 0")

    from taps_ray.config import load_config
    from taps_ray.serving.app import run as serve_app

    cfg = load_config(args.config, args.overrides)
    prompts = PROMPTS[:args.prompts]
    local = in_process(cfg, args.strategy, prompts, args.max_tokens)
    print(f"in-process {args.strategy}: {local['tokens']} tokens in {local['seconds']:.1f}s = "
          f"{local['tokens_per_s']:.2f} tok/s, tau {local['tau']:.2f}", flush=True)

    url = serve_app(cfg, blocking=False)
    load = argparse.Namespace(url=url, model=None, strategy=args.strategy, max_tokens=args.max_tokens,
                              temperature=0.0, seed=None, timeout=600.0, verbose=False, verify=None)
    run_load(argparse.Namespace(**{**vars(load), "concurrency": 1, "requests": 1, "duration": None}))
    single = run_load(argparse.Namespace(**{**vars(load), "concurrency": 1, "requests": len(prompts), "duration": None}))
    s = single["summary"]
    texts = [r["text"] for r in single["records"]]
    result = {
        "config": args.config, "overrides": args.overrides, "strategy": args.strategy, "max_tokens": args.max_tokens,
        "in_process": {k: v for k, v in local.items() if k != "texts"},
        "http_single_stream": {"tokens": s["completion_tokens"], "seconds": s["wall_s"],
                               "tokens_per_s": s["output_tokens_per_s"], "tau": s["tau"],
                               "latency_s": s["latency_s"], "ttft_s": s["ttft_s"],
                               "skipped_drafter_steps": s["skipped_drafter_steps"]},
        "http_over_in_process": s["output_tokens_per_s"] / local["tokens_per_s"],
        "identical_texts": sum(a == b for a, b in zip(texts, local["texts"], strict=True)),
        "prompts": len(prompts),
    }
    print(f"HTTP single stream: {s['completion_tokens']} tokens in {s['wall_s']:.1f}s = "
          f"{s['output_tokens_per_s']:.2f} tok/s ({100 * result['http_over_in_process']:.0f}% of in-process), "
          f"{result['identical_texts']}/{len(prompts)} texts identical", flush=True)

    if args.soak:
        samples, stop, killed = [], threading.Event(), []

        def sample() -> None:
            while not stop.is_set():
                samples.append({"t": time.time(), "rss_mib": replica_rss()})
                stop.wait(5.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if args.kill_drafter_after is not None:
            threading.Thread(target=kill_one_drafter, args=(args.kill_drafter_after, killed), daemon=True).start()
        soak = run_load(argparse.Namespace(**{**vars(load), "concurrency": args.concurrency, "requests": None,
                                              "duration": args.soak, "verify": args.config,
                                              "strategy": args.soak_strategy or args.strategy}))
        stop.set()
        sampler.join()
        names = sorted({n.split("[")[0] for x in samples for n in x["rss_mib"]})
        memory = {}
        for name in names:
            series = [sum(v for k, v in x["rss_mib"].items() if k.split("[")[0] == name) for x in samples]
            memory[name] = {"first": series[0], "last": series[-1], "max": max(series)}
        result["soak"] = {**soak["summary"], "memory_mib": memory, "killed": killed, "rss_samples": samples}
        print(json.dumps({k: v for k, v in result["soak"].items() if k != "rss_samples"}, indent=1, default=str),
              flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if not args.soak or result["soak"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
