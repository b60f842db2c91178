"""Serving cost and robustness: one command that starts the Serve app in-process and measures it.

    python benchmarks/bench_serving.py configs/demo.yaml \
        'serve.drafters={math: runs/demo/drafters/hass-math, chat: runs/demo/drafters/hass-chat}' \
        --strategy single --prompts 6 --max-tokens 64 \
        [--soak 120 --concurrency 8 --soak-strategy merged:budget --kill-drafter-after 30] \
        [--out runs/bench/serving.json]

1. In-process, before Ray starts: the config's target and the strategy's drafters decode
   ``--prompts`` prompts of ``benchmarks/load_test.py`` greedily, one after another.
2. Single stream over HTTP, ``--rounds`` times: the same prompts through ``/v1/chat/completions``
   (streaming, the official ``openai`` client), one request at a time, each round followed by the
   in-process run again beside the running (idle) app, so both see the same machine; tokens/s, the
   per-step split (waiting for drafts, drafting, verifying), the ratios to both in-process figures
   (medians over rounds), and whether every text equals the in-process one. Each round also runs
   the in-process decoding in a separate process that never joins Ray (what an idle Ray cluster
   on the same cores costs any process).
3. ``--soak S``: ``--concurrency`` clients for S seconds with ``--soak-strategy`` (default
   ``--strategy``), outputs checked against in-process greedy (the load test); replica RSS
   sampled every 5 s (``memory_mib``: first, middle, last, largest sample and the growth over the
   second half, per deployment) and, once the load is over, the drafting sessions still open and
   the verifier's requests in flight (``left_behind``: all 0 when nothing is kept per request); with
   ``--kill-drafter-after T`` one drafter replica is killed T seconds in.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_test import PROMPTS  # noqa: E402
from load_test import run as run_load  # noqa: E402


class InProcess:
    """Greedy decoding with ``strategy`` over the config's served drafters, in this process."""

    def __init__(self, cfg, strategy: str):
        from taps_ray.models.target import TargetModel
        from taps_ray.serving.app import drafter_user_config
        from taps_ray.serving.drafter import build_drafter
        from taps_ray.serving.plan import resolve_plan
        from taps_ray.spec.compose import build_strategy

        self.target = TargetModel.load(cfg.target)
        plan = resolve_plan(strategy, None, cfg.serve)
        heads = {name: build_drafter(self.target, drafter_user_config(cfg, name), name) for name in plan.drafters}
        self.decoder = build_strategy(plan.spec, heads, cfg.tree, probe_steps=cfg.serve.route_probe_steps,
                                      recheck_every=cfg.serve.route_recheck_every)
        self.run([PROMPTS[0]], 8)

    def run(self, prompts: list[str], max_tokens: int) -> dict:
        from taps_ray.spec.decoder import generate

        texts, tokens, seconds, steps = [], 0, 0.0, 0
        for prompt in prompts:
            start = time.perf_counter()
            result = generate(self.target, [{"role": "user", "content": prompt}], self.decoder,
                              max_new_tokens=max_tokens)
            seconds += time.perf_counter() - start
            texts.append(result.text)
            tokens += len(result.token_ids)
            steps += len(result.steps)
        return {"texts": texts, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "tau": tokens / steps if steps else None}


def http_single_stream(load: argparse.Namespace, count: int) -> dict:
    """``count`` prompts through the server, one request at a time."""
    single = run_load(argparse.Namespace(**{**vars(load), "concurrency": 1, "requests": count, "duration": None}))
    s = single["summary"]
    return {"texts": [r["text"] for r in single["records"]], "tokens": s["completion_tokens"], "seconds": s["wall_s"],
            "tokens_per_s": s["output_tokens_per_s"], "tau": s["tau"], "latency_s": s["latency_s"],
            "ttft_s": s["ttft_s"], "skipped_drafter_steps": s["skipped_drafter_steps"],
            "draft_s": sum(r["taps"].get("draft_s", 0.0) for r in single["records"]),
            "drafter_compute_s": sum(r["taps"].get("drafter_compute_s", 0.0) for r in single["records"]),
            "verify_s": sum(r["taps"].get("verify_s", 0.0) for r in single["records"]),
            "steps": sum(r["taps"].get("steps", 0) for r in single["records"])}


def flatness(samples: list[dict], name: str) -> dict:
    """MiB of ``name``'s replicas (summed) at the first sample, the middle, the end and the largest, and
    the growth over the second half of the soak (a per-request leak keeps growing there)."""
    series = [sum(v for k, v in x["rss_mib"].items() if k.split("[")[0] == name) for x in samples]
    mid = series[len(series) // 2]
    return {"first": series[0], "middle": mid, "last": series[-1], "max": max(series),
            "second_half_growth": round(series[-1] - mid, 1)}


def separate_process(args: argparse.Namespace) -> dict:
    """The in-process run in a fresh Python process that never joins Ray (``--local-only``)."""
    command = [sys.executable, __file__, args.config, *args.overrides, "--strategy", args.strategy,
               "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens), "--local-only"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def left_behind(cfg) -> dict:
    """Per-request state still held once the load is over: each drafter replica's open sessions
    (after its idle reaping) and the verifier's requests in flight."""
    from ray import serve

    from taps_ray.serving.app import drafter_deployment_name

    state = {"verifier_active": serve.get_deployment_handle("Verifier", cfg.serve.app_name).info.remote().result()["active"]}
    for name in cfg.serve.drafters:
        stats = serve.get_deployment_handle(drafter_deployment_name(name), cfg.serve.app_name).stats.remote().result()
        state[f"drafter_{name}"] = {"sessions": stats["sessions"], "opened": stats["opened"]}
    return state


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2


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
    parser.add_argument("--rounds", type=int, default=3,
                        help="single-stream rounds, each HTTP then in-process beside the running app")
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of concurrent load (0: none)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--soak-strategy", default=None, help="strategy of the soak (default: --strategy)")
    parser.add_argument("--kill-drafter-after", type=float, default=None, metavar="S")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--local-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS) or min(args.max_tokens, args.concurrency, args.rounds) < 1 \
            or args.soak < 0:
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}; --max-tokens, --concurrency, --rounds > 0; --soak >= 0")

    from taps_ray.config import load_config
    from taps_ray.serving.app import run as serve_app

    cfg = load_config(args.config, args.overrides)
    prompts = PROMPTS[:args.prompts]
    local = InProcess(cfg, args.strategy)
    if args.local_only:
        print(json.dumps({k: v for k, v in local.run(prompts, args.max_tokens).items() if k != "texts"}))
        return 0
    quiet = local.run(prompts, args.max_tokens)
    print(f"in-process {args.strategy}, before Ray starts: {quiet['tokens']} tokens in {quiet['seconds']:.1f}s = "
          f"{quiet['tokens_per_s']:.2f} tok/s, tau {quiet['tau']:.2f}", flush=True)

    url = serve_app(cfg, blocking=False)
    load = argparse.Namespace(url=url, model=None, strategy=args.strategy, max_tokens=args.max_tokens,
                              temperature=0.0, seed=None, timeout=600.0, verbose=False, verify=None)
    http_single_stream(load, 1)
    rounds = []
    for i in range(args.rounds):
        http = http_single_stream(load, len(prompts))
        beside = local.run(prompts, args.max_tokens)
        apart = separate_process(args)
        rounds.append({"http": {k: v for k, v in http.items() if k != "texts"},
                       "in_process_beside_app": {k: v for k, v in beside.items() if k != "texts"},
                       "separate_process_beside_app": apart,
                       "http_over_in_process_beside_app": http["tokens_per_s"] / beside["tokens_per_s"],
                       "identical_texts": sum(a == b for a, b in zip(http["texts"], quiet["texts"], strict=True))})
        steps = max(http["steps"], 1)
        print(f"round {i + 1}: HTTP {http['tokens_per_s']:.2f} tok/s (per step: wait for drafts "
              f"{1000 * http['draft_s'] / steps:.1f} ms, of it drafting {1000 * http['drafter_compute_s'] / steps:.1f}; "
              f"verify {1000 * http['verify_s'] / steps:.1f}), in-process beside the app {beside['tokens_per_s']:.2f} "
              f"tok/s: {100 * rounds[-1]['http_over_in_process_beside_app']:.0f}%; a separate process without Ray "
              f"{apart['tokens_per_s']:.2f} tok/s; "
              f"{rounds[-1]['identical_texts']}/{len(prompts)} texts identical", flush=True)
    http_tps = median([r["http"]["tokens_per_s"] for r in rounds])
    result = {
        "config": args.config, "overrides": args.overrides, "strategy": args.strategy, "max_tokens": args.max_tokens,
        "prompts": len(prompts), "in_process_before_ray": {k: v for k, v in quiet.items() if k != "texts"},
        "rounds": rounds, "http_tokens_per_s_median": http_tps,
        "http_over_in_process_beside_app_median": median([r["http_over_in_process_beside_app"] for r in rounds]),
        "http_over_in_process_before_ray": http_tps / quiet["tokens_per_s"],
        "separate_process_beside_app_median": median([r["separate_process_beside_app"]["tokens_per_s"] for r in rounds]),
        "identical_texts": min(r["identical_texts"] for r in rounds),
    }
    print(f"HTTP single stream (median of {args.rounds} rounds): {http_tps:.2f} tok/s = "
          f"{100 * result['http_over_in_process_beside_app_median']:.0f}% of in-process beside the idle app, "
          f"{100 * result['http_over_in_process_before_ray']:.0f}% of in-process before Ray started "
          f"({quiet['tokens_per_s']:.2f} tok/s; a separate process beside the idle app: "
          f"{result['separate_process_beside_app_median']:.2f})", flush=True)

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
        memory = {name: flatness(samples, name) for name in names}
        result["soak"] = {**soak["summary"], "memory_mib": memory, "killed": killed,
                          "left_behind": left_behind(cfg), "rss_samples": samples}
        print(json.dumps({k: v for k, v in result["soak"].items() if k != "rss_samples"}, indent=1, default=str),
              flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if not args.soak or result["soak"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
