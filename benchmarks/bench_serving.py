"""Serving cost and robustness: one command that starts the Serve app in-process and measures it.

    python benchmarks/bench_serving.py configs/demo.yaml \
        'serve.drafters={math: runs/demo/drafters/hass-math, chat: runs/demo/drafters/hass-chat}' \
        --strategy single --prompts 6 --max-tokens 64 \
        [--soak 120 --concurrency 8 --soak-strategy merged:budget --kill-drafter-after 30 \
         --hangup-fraction 0.2] [--out runs/bench/serving.json]

1. In-process, before Ray starts: the config's target and the strategy's drafters decode
   ``--prompts`` prompts of ``benchmarks/load_test.py`` greedily, one after another.
2. Single stream over HTTP, ``--rounds`` times: the same prompts through ``/v1/chat/completions``
   (streaming, the official ``openai`` client), one request at a time, each round followed by the
   in-process run again beside the running (idle) app, so both see the same machine; tokens/s, the
   per-step split (waiting for drafts, drafting, verifying), the ratios to both in-process figures
   (medians over rounds), and whether every text equals the in-process one. Each round also runs
   the in-process decoding in a separate process that never joins Ray (what an idle Ray cluster
   on the same cores costs any process). ``--rounds 0`` skips 1. and 2.
3. ``--soak S``: ``--concurrency`` clients for S seconds with ``--soak-strategy`` (default
   ``--strategy``), a ``--hangup-fraction`` of them hanging up after the first content chunk and
   429s retried after their Retry-After (the load test's outcomes: completed, hung up, still refused,
   errors); completed outputs checked against in-process greedy once the load is over. The resident
   memory of every process of this Ray session (the benchmark process's descendants: GCS, raylet,
   Serve controller, proxy, replicas, agents, idle workers) and of the benchmark process is sampled
   every ``--sample-every`` seconds and summed per group (:func:`process_group`; ``memory_mib``:
   start, end, max and the least-squares slope over the whole load and its second half, MiB/min);
   once the load is over, the drafting sessions still open and the verifier's requests in flight
   (``left_behind``: all 0 when nothing is kept per request); with ``--kill-drafter-after T`` one
   drafter replica is killed T seconds in. The serve limits in force (``serve.admission.max_concurrent_requests``,
   ``serve.admission.max_queued_requests``: set them as overrides) are recorded.
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

from load_test import PROMPTS, Record, verify  # noqa: E402
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
        self.decoder = build_strategy(plan.spec, heads, cfg.tree, probe_steps=cfg.serve.routing.probe_steps,
                                      recheck_every=cfg.serve.routing.recheck_every)
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


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, MiB)`` points in MiB per minute (None with under two distinct times)."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t, mean_y = sum(t for t, _ in points) / n, sum(y for _, y in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mean_t) * (y - mean_y) for t, y in points) / var


def flatness(samples: list[dict], group: str) -> dict:
    """MiB of ``group`` (summed over its processes) at the first and last sample, the largest, and the
    least-squares slope over all samples and over the second half (a per-request leak keeps growing
    there, after allocators have warmed up)."""
    points = [(x["t"], x["mib"].get(group, 0.0)) for x in samples]
    series = [y for _, y in points]
    half = points[len(points) // 2:]
    rounded = [None if v is None else round(v, 2) for v in (slope_per_min(points), slope_per_min(half))]
    return {"start": series[0], "end": series[-1], "max": max(series), "slope_mib_per_min": rounded[0],
            "second_half_slope_mib_per_min": rounded[1]}


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


RAY_PROGRAMS = {"gcs_server": "gcs", "raylet": "raylet", "log_monitor.py": "log_monitor",
                "monitor.py": "autoscaler_monitor", "dashboard.py": "dashboard"}
"""Ray's own programs by the file name their command line runs."""


def process_group(cmdline: list[str], is_self: bool = False) -> str:
    """The memory group of a process of this Ray session from its command line: ``benchmark`` (this
    process), a Serve deployment by name (``Verifier``, ``Drafter_math``, ``Ingress``: a replica's
    ``ray::ServeReplica:APP:NAME`` title, any ``.method`` suffix dropped, also while it starts), ``serve_controller``,
    ``proxy``, ``idle_workers``, another actor's or worker's class (``ray::NAME``), or a Ray program
    (:data:`RAY_PROGRAMS`: GCS, raylet, ...); else ``other:PROGRAM``."""
    if is_self:
        return "benchmark"
    title = " ".join(cmdline).strip()
    if title.startswith("ray::"):
        name = title.split()[0][len("ray::"):]
        if "ServeReplica:" in name:  # a starting replica's title is SERVE_REPLICA::APP#NAME#ID:ServeReplica:APP:NAME
            return name.split("ServeReplica:", 1)[1].split(":", 1)[-1].split(".")[0]
        if name.startswith("ServeController"):
            return "serve_controller"
        if name.startswith("ProxyActor"):
            return "proxy"
        if name.startswith("IDLE"):
            return "idle_workers"
        return name.split(".")[0] or "other"
    for arg in cmdline[:3]:
        program = Path(arg).name
        if program in RAY_PROGRAMS:
            return RAY_PROGRAMS[program]
    return f"other:{Path(cmdline[0]).name}" if cmdline and cmdline[0] else "other"


def session_rss() -> dict[str, float]:
    """MiB of resident memory per :func:`process_group` of this process and its descendants (with an
    in-process Ray cluster: every process of this Ray session, and no other cluster's)."""
    import psutil

    me = psutil.Process()
    sizes: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            group = process_group(proc.cmdline(), proc.pid == me.pid)
            rss = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        sizes[group] = round(sizes.get(group, 0.0) + rss / 2**20, 1)
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
                        help="single-stream rounds, each HTTP then in-process beside the running app (0: none)")
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of concurrent load (0: none)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--soak-strategy", default=None, help="strategy of the soak (default: --strategy)")
    parser.add_argument("--kill-drafter-after", type=float, default=None, metavar="S")
    parser.add_argument("--hangup-fraction", type=float, default=0.0,
                        help="share of soak requests that hang up after the first content chunk")
    parser.add_argument("--hangup-seed", type=int, default=0)
    parser.add_argument("--sample-every", type=float, default=5.0, metavar="S", help="memory sampling period")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--local-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS) or min(args.max_tokens, args.concurrency) < 1 or args.rounds < 0 \
            or args.soak < 0 or not 0 <= args.hangup_fraction <= 1 or args.sample_every <= 0:
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}; --max-tokens, --concurrency, --sample-every > 0; "
                     "--rounds, --soak >= 0; --hangup-fraction in [0, 1]")

    from taps_ray.config import load_config
    from taps_ray.serving.app import run as serve_app

    cfg = load_config(args.config, args.overrides)
    prompts = PROMPTS[:args.prompts]
    local = InProcess(cfg, args.strategy) if args.rounds or args.local_only else None
    if args.local_only:
        print(json.dumps({k: v for k, v in local.run(prompts, args.max_tokens).items() if k != "texts"}))
        return 0
    quiet = local.run(prompts, args.max_tokens) if local else None
    if quiet:
        print(f"in-process {args.strategy}, before Ray starts: {quiet['tokens']} tokens in {quiet['seconds']:.1f}s = "
              f"{quiet['tokens_per_s']:.2f} tok/s, tau {quiet['tau']:.2f}", flush=True)

    url = serve_app(cfg, blocking=False)
    load = argparse.Namespace(url=url, model=None, strategy=args.strategy, max_tokens=args.max_tokens,
                              temperature=0.0, seed=None, timeout=600.0, verbose=False, verify=None)
    http_single_stream(load, 1)
    result = {"config": args.config, "overrides": args.overrides, "strategy": args.strategy,
              "max_tokens": args.max_tokens, "prompts": len(prompts),
              "serve_limits": {"max_concurrent_requests": cfg.serve.admission.max_concurrent_requests,
                               "max_queued_requests": cfg.serve.admission.max_queued_requests,
                               "retry_after_s": cfg.serve.admission.retry_after_s,
                               "request_timeout_s": cfg.serve.limits.request_timeout_s}}
    if args.rounds:
        result.update(single_stream(args, local, quiet, load, prompts))
    if args.soak:
        result["soak"] = soak(args, cfg, load)
        print(json.dumps({k: v for k, v in result["soak"].items() if k not in ("rss_samples", "records")},
                         indent=1, default=str), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}", file=sys.stderr)
    checked = result["soak"]["verify"] if args.soak else {}
    return 0 if not args.soak or (result["soak"]["errors"] == 0 and not checked["mismatched"]
                                  and not checked["partial_not_prefix"]) else 1


def single_stream(args: argparse.Namespace, local: InProcess, quiet: dict, load: argparse.Namespace,
                  prompts: list[str]) -> dict:
    """``--rounds`` rounds: the prompts over HTTP one at a time, then in-process beside the app and in a
    separate process; medians and ratios."""
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
        "in_process_before_ray": {k: v for k, v in quiet.items() if k != "texts"},
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
    return result


def soak(args: argparse.Namespace, cfg, load: argparse.Namespace) -> dict:
    """``--concurrency`` clients for ``--soak`` seconds (hang-ups, 429 retries, a drafter killed), session
    memory sampled throughout; then what is left behind, one more memory sample, and the completed
    outputs against in-process greedy (after the sampling: the reference target loads in this process)."""
    samples, stop, killed = [], threading.Event(), []
    began = time.time()

    def sample() -> None:
        while not stop.is_set():
            samples.append({"t": round(time.time() - began, 1), "mib": session_rss()})
            stop.wait(args.sample_every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if args.kill_drafter_after is not None:
        threading.Thread(target=kill_one_drafter, args=(args.kill_drafter_after, killed), daemon=True).start()
    out = run_load(argparse.Namespace(**{**vars(load), "concurrency": args.concurrency, "requests": None,
                                         "duration": args.soak, "strategy": args.soak_strategy or args.strategy,
                                         "hangup_fraction": args.hangup_fraction, "hangup_seed": args.hangup_seed}))
    stop.set()
    sampler.join()
    behind = left_behind(cfg)
    after = {"t": round(time.time() - began, 1), "mib": session_rss()}
    groups = sorted({g for x in samples for g in x["mib"]})
    records = [Record(**r) for r in out["records"]]
    checked = verify(args.config, [r for r in records if r.outcome == "completed"], args.max_tokens,
                     [r for r in records if r.outcome == "hung_up"], args.overrides)
    return {**out["summary"], "verify": checked, "killed": killed, "left_behind": behind,
            "memory_mib": {g: {**flatness(samples, g), "after_load": after["mib"].get(g, 0.0)} for g in groups},
            "rss_samples": [*samples, {**after, "after_load": True}], "records": out["records"]}


if __name__ == "__main__":
    sys.exit(main())
