"""A drafter that learns the served workload: capture, one ``taps adapt --watch`` round, gated promotion.

    python benchmarks/adapt_experiment.py configs/demo.yaml [overrides ...] [--drafter chat] \
        [--served math=release:math,chat=release:chat] [--traffic 256] [--heldout 16] [--max-tokens 64] \
        [--concurrency 4] [--out runs/adapt-experiment]

1. Serve the ``--served`` drafters (default: the release ``math`` and ``chat``; the demo's are
   ``math=runs/demo/drafters/hass-math,chat=runs/demo/drafters/hass-chat``) on the target of the config, in
   float32 so served outputs can be compared with in-process greedy token for token, with
   ``serve.capture`` on.
2. A third domain no served drafter trained on: ShareGPT conversations whose first user turn asks about
   code (:func:`coding_prompts`), less every prompt a release or served drafter or the config's own
   ``chat`` data trained on; ``--heldout`` of them held out, the next ``--traffic`` are the traffic. Held
   out too: ``--heldout`` GSM8K test questions and MT-Bench first turns (the original domains), none a
   served drafter trained on.
3. Before: tau of ``--drafter`` on the three held-out sets, decoded in-process (``single``, the config's
   tree, greedy).
4. The traffic is replayed through the endpoint (``single:DRAFTER``, ``--concurrency`` clients).
5. One round of :class:`taps_ray.adapt.watch.Watch` (``adapt.every`` = the traffic) adapts the serving
   version (on a frozen copy of the capture folder) and promotes it if it passes the gate. While it
   trains, clients keep sending 8 assorted prompts of ``load_test.py`` (in no held-out set): every answer
   must be a 200 and equal in-process vanilla greedy.
6. After: tau of the version now serving on the same held-out sets.
7. With ``--control``: the source fine-tuned by the same recipe on its original data alone (traffic share 0,
   the same frozen traffic folder for its held-out rows), decoded the same way: the gain that the extra
   training brings without the traffic.

Also counted: the Verifier's target forwards (per batch size) against the verification steps of every
served request, so capture's features come from no extra target pass. Writes ``result.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import requests  # noqa: E402
from load_test import PROMPTS as DURING_PROMPTS  # noqa: E402
from load_test import run as run_load  # noqa: E402

SHARD_ROWS = 32

CODE = re.compile(r"```|\b(python|javascript|typescript|java|c\+\+|golang|rust|sql|bash|regex|function|"
                  r"def |class |code|script|program|compile|api|json|html|css|react|django|pandas)\b", re.I)


def coding_prompts(excluded: set[str], max_chars: int = 600) -> list[str]:
    """First user turns of ShareGPT conversations that ask about code, at most ``max_chars`` long, whose
    hash is not in ``excluded``, deduplicated, in the file's order."""
    from taps_ray.config import SourceSpec
    from taps_ray.data.contamination import prompt_hash
    from taps_ray.data.sources import load_source

    seen, out = set(excluded), []
    for conversation in load_source(SourceSpec(kind="sharegpt")).conversations:
        first = next((t["content"] for t in conversation if t["role"] == "user"), "")
        if not 20 <= len(first) <= max_chars or not CODE.search(first):
            continue
        key = prompt_hash(first)
        if key not in seen:
            seen.add(key)
            out.append(first)
    return out


def excluded_hashes(cfg, served: dict[str, str]) -> set[str]:
    """Prompts the release drafters, the ``served`` ones and the config's ``chat`` dataset trained on."""
    from taps_ray.data.contamination import conversation_hash, union_trained_prompts
    from taps_ray.data.sources import load_dataset_alternatives
    from taps_ray.drafter_sources import release_names, resolve_drafter_dir

    dirs = [resolve_drafter_dir(f"release:{n}") for n in release_names()]
    hashes = union_trained_prompts([*dirs, *(resolve_drafter_dir(c) for c in served.values())])
    if "chat" in cfg.data.datasets:
        hashes |= {conversation_hash(c) for c in load_dataset_alternatives(cfg.data.datasets["chat"]).conversations}
    return hashes


def pooled_tau(target, drafter, tree, prompts: list[str], max_tokens: int) -> dict:
    """tau of ``drafter`` (``single``) over ``prompts``, decoded in-process: pooled and per prompt."""
    from taps_ray.spec import stats
    from taps_ray.spec.decoder import generate
    from taps_ray.spec.protocol import SingleStrategy

    steps, per_prompt = [], []
    for prompt in prompts:
        result = generate(target, [{"role": "user", "content": prompt}], SingleStrategy(drafter, tree),
                          max_new_tokens=max_tokens)
        steps += result.steps
        per_prompt.append(round(result.tau, 3))
    return {"tau": round(stats.tau(steps), 4), "steps": len(steps), "per_prompt": per_prompt}


def heldout_taus(target, checkpoint: str, tree, sets: dict[str, list[str]], max_tokens: int) -> dict:
    from taps_ray.models.drafter import DraftHead

    drafter = DraftHead.load(checkpoint, target.config, target.fingerprint, target.device, target.dtype).eval()
    return {name: pooled_tau(target, drafter, tree, prompts, max_tokens) for name, prompts in sets.items()}


def load_args(url: str, strategy: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int):
    return argparse.Namespace(url=url, model=None, strategy=strategy, concurrency=concurrency, requests=requests,
                              duration=None, max_tokens=max_tokens, temperature=0.0, seed=None, timeout=900.0,
                              verbose=False, verify=None, hangup_fraction=0.0, prompt_texts=prompts)


def vanilla_texts(target, prompts: list[str], max_tokens: int) -> dict[str, str]:
    from taps_ray.spec.decoder import generate

    return {p: generate(target, [{"role": "user", "content": p}], None, max_new_tokens=max_tokens).text
            for p in prompts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--drafter", default="chat", help="the served drafter adapted (a name of --served)")
    parser.add_argument("--served", default="math=release:math,chat=release:chat",
                        help="NAME=CHECKPOINT,... the drafters served (and the one adapted among them)")
    parser.add_argument("--traffic", type=int, default=256, help="third-domain requests replayed before the round")
    parser.add_argument("--heldout", type=int, default=16, help="held-out prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", default="runs/adapt-experiment")
    parser.add_argument("--control", action="store_true",
                        help="also adapt the source on its original data only (traffic share 0) and decode it")
    args = parser.parse_args(argv)

    from ray import serve

    from taps_ray.adapt.promote import ServedDrafter
    from taps_ray.adapt.watch import Watch
    from taps_ray.config import load_config
    from taps_ray.data.benchmarks import load_benchmark
    from taps_ray.data.capture import captured_requests
    from taps_ray.models.target import TargetModel
    from taps_ray.serving.app import run as serve_app
    from taps_ray.train.launch import load_training_target

    served = dict(item.split("=", 1) for item in args.served.split(","))
    if args.drafter not in served:
        raise SystemExit(f"--drafter {args.drafter!r} is not one of --served ({', '.join(served)})")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    capture = {"enabled": True, "dir": str(out / "capture"), "rows_per_shard": SHARD_ROWS, "mode": "all"}
    cfg = load_config(args.config, [
        "name=adapt-experiment", f"output_dir={out}", "target.dtype=float32",
        f"serve.drafters={json.dumps(served)}", f"serve.capture={json.dumps(capture)}", "serve.show_acceptance=true",
        "serve.http.port=8013", "serve.routing.draft_deadline_s=30", "serve.limits.request_timeout_s=900",
        f"adapt.drafter={args.drafter}", "adapt.rounds=1", "adapt.poll_s=5",
        *args.overrides])
    started = time.time()
    excluded = excluded_hashes(cfg, served)
    code = coding_prompts(excluded)
    if len(code) < args.heldout + args.traffic:
        raise SystemExit(f"only {len(code)} coding prompts; ask for fewer")
    random.Random(0).shuffle(code)
    sets = {"code": code[:args.heldout],
            "gsm8k": [q.turns[0] for q in load_benchmark("gsm8k", args.heldout, exclude=excluded)],
            "mt_bench": [q.turns[0] for q in load_benchmark("mt_bench", args.heldout, exclude=excluded)]}
    traffic = code[args.heldout:args.heldout + args.traffic]
    checkpoint = served[args.drafter]
    target = TargetModel.load(cfg.target)
    before = heldout_taus(target, checkpoint, cfg.tree, sets, args.max_tokens)
    print("before:", {n: t["tau"] for n, t in before.items()}, flush=True)
    during_prompts = DURING_PROMPTS[:8]  # none of them held out: what is captured meanwhile stays out of every set
    reference = vanilla_texts(target, during_prompts, args.max_tokens)

    url = serve_app(cfg, blocking=False)
    try:
        replay = run_load(load_args(url, f"single:{args.drafter}", traffic, len(traffic), args.concurrency,
                                    args.max_tokens))
        print("replayed:", replay["summary"]["ok"], "ok of", replay["summary"]["requests"], flush=True)
        written = len(traffic) - len(traffic) % SHARD_ROWS  # a verifier replica writes its rows 32 at a time
        deadline = time.time() + 600
        while captured_requests(out / "capture")[0] < written and time.time() < deadline:
            time.sleep(2)
        round_cfg = cfg.model_copy(update={"adapt": cfg.adapt.model_copy(update={"every": written})})
        watch = Watch(round_cfg, args.drafter, ServedDrafter(cfg, args.drafter), out / "capture",
                      target=load_training_target(cfg))
        rounds: list = []
        thread = threading.Thread(target=lambda: rounds.extend(watch.run()), name="adapt-watch")
        thread.start()
        during = []
        while thread.is_alive():
            batch = run_load(load_args(url, f"single:{args.drafter}", during_prompts, len(during_prompts), 2,
                                       args.max_tokens))
            during += batch["records"]
        thread.join()
        info = serve.get_deployment_handle("Verifier", cfg.serve.app_name).info.remote().result()
        models = requests.get(f"{url}/v1/models", timeout=30).json()
    finally:
        serve.delete(cfg.serve.app_name)
    if not rounds:
        raise SystemExit("the adapt round failed; see the log")
    entry = rounds[0]
    serving = entry.checkpoint if entry.promoted else checkpoint
    after = heldout_taus(target, serving, cfg.tree, sets, args.max_tokens)
    print("after:", {n: t["tau"] for n, t in after.items()}, flush=True)
    control = None
    if args.control:
        from taps_ray.adapt.finetune import run_adapt

        frozen = sorted((cfg.run_dir / "adapt").glob("traffic-*"))[-1]
        made = run_adapt(cfg, frozen, checkpoint, share=0.0, target=load_training_target(cfg))
        control = {"checkpoint": str(made.out), "adapt": made.record,
                   "tau": heldout_taus(target, str(made.out), cfg.tree, sets, args.max_tokens)}
        print("control (no traffic):", {n: t["tau"] for n, t in control["tau"].items()}, flush=True)
    records = replay["records"] + during
    forwards = {int(k): v for k, v in info["batches"].items()}
    result = {
        "command": " ".join(["python benchmarks/adapt_experiment.py", *sys.argv[1:]] if argv is None else argv),
        "config": args.config, "drafter": args.drafter, "served": served, "max_tokens": args.max_tokens, "heldout": args.heldout,
        "traffic_requests": len(traffic), "traffic_ok": replay["summary"]["ok"],
        "traffic_errors": replay["summary"]["errors"],
        "promotion": asdict(entry),
        "tau_before": {n: t["tau"] for n, t in before.items()}, "tau_after": {n: t["tau"] for n, t in after.items()},
        "tau_detail": {"before": before, "after": after},
        "tau_control": None if control is None else {n: t["tau"] for n, t in control["tau"].items()},
        "control": control,
        "during_adaptation": {"requests": len(during), "ok": sum(r["ok"] for r in during),
                              "identical_to_vanilla": sum(r["ok"] and r["text"] == reference[during_prompts[r["prompt"]]]
                                                          for r in during)},
        "target_forwards": forwards, "verified_steps_in_forwards": sum(k * v for k, v in forwards.items()),
        "served_steps": sum(r["taps"].get("steps", 0) for r in records if r["ok"]),
        "models": models["data"][0]["taps"]["drafters"],
        "wall_s": round(time.time() - started, 1),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "tau_detail"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
