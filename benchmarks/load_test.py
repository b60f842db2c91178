"""Load test of an OpenAI-compatible taps_ray server.

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --concurrency 8 --requests 64 \
        --strategy single [--duration 90] [--max-tokens 32] [--hangup-fraction 0.2] [--out load.json] \
        [--verify configs/demo.yaml]

C client threads send streaming chat completions (the official ``openai`` client, greedy by
default) round-robin over a fixed prompt set until N requests are done or ``--duration`` seconds
have passed. Each request ends in one outcome (:data:`OUTCOMES`): ``completed``; ``hung_up`` (by
design: a ``--hangup-fraction`` share of the requests closes its stream after the first content chunk;
:func:`hangup_plan` picks them with a ``--hangup-seed`` RNG, the share exact in every block of 10); ``rejected_429`` (still refused when the
run ended: a 429 is retried after its ``Retry-After``, each refusal counted in ``refused_429``) or
``error`` (anything else; ``errors`` counts only these). Reports throughput of completed requests
(requests/s, output tokens/s), their latency (the answered attempt, and from the first attempt with
429 waits) and time to first token (p50/p95/p99), and the mean acceptance length; writes
everything, per request too, as JSON. ``--verify CONFIG`` decodes each distinct prompt in-process
(vanilla greedy on the config's target) and counts completed responses whose text differs, and
hung-up ones whose partial text is not a prefix of it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROMPTS = [
    "What is 12 times 7? Answer with the number and one sentence.",
    "Write two sentences about the ocean at night.",
    "A train travels 60 km in 45 minutes. What is its speed in km/h?",
    "Give three tips for staying focused while studying.",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell altogether?",
    "Explain what a prime number is to a ten-year-old.",
    "List four fruits that are red.",
    "If x + 5 = 12, what is x? Show the step.",
    "Describe a cat in one short paragraph.",
    "What is the sum of the first five odd numbers?",
    "Suggest a name for a coffee shop and explain it briefly.",
    "How many minutes are there in three and a half hours?",
]


OUTCOMES = ("completed", "hung_up", "rejected_429", "error")
"""A request's end: answered in full; closed by the client after its first content chunk (by design);
refused with 429 until the run ended; anything else (an error)."""


@dataclass
class Record:
    index: int
    prompt: int
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    taps: dict = field(default_factory=dict)
    outcome: str = "completed"
    refused_429: int = 0
    retry_after_s: float | None = None
    total_s: float = 0.0


def outcome_of(err: BaseException | None, hung_up: bool = False) -> str:
    """The outcome of an attempt that ended with ``err`` (None: it ended normally, or, with ``hung_up``,
    the client closed it by design)."""
    if err is None:
        return "hung_up" if hung_up else "completed"
    return "rejected_429" if getattr(err, "status_code", None) == 429 else "error"


def retry_after_s(err: BaseException, default: float = 1.0) -> float:
    """Seconds a 429 asks the client to wait (its ``Retry-After`` header in seconds; ``default`` without one)."""
    response = getattr(err, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:
        return default


def hangup_plan(fraction: float, seed: int = 0, block: int = 10) -> Iterator[bool]:
    """Whether request 0, 1, 2, ... hangs up: in each ``block`` of requests a seeded RNG picks which
    ones, as many as keep the running count at ``round(fraction * requests so far)`` at every block end
    (so the share is exact over any whole number of blocks, and never off by more than a block's worth)."""
    rng = random.Random(seed)
    for b in itertools.count():
        picks = round((b + 1) * block * fraction) - round(b * block * fraction)
        chosen = set(rng.sample(range(block), picks))
        yield from (i in chosen for i in range(block))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99), "mean": sum(ordered) / len(ordered)}


def one_attempt(client, model: str, index: int, prompt: int, args, hang_up: bool = False) -> Record:
    """One streamed request; with ``hang_up`` the stream is closed after its first content chunk."""
    start = time.perf_counter()
    ttft, parts, usage, finish, taps = None, [], None, None, {}
    extra = {"taps": {"strategy": args.strategy}} if args.strategy else {}
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt_set(args)[prompt]}], max_tokens=args.max_tokens,
            temperature=args.temperature, seed=args.seed, stream=True, stream_options={"include_usage": True},
            extra_body=extra)
        for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta.content or ""
                if delta and ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(delta)
                finish = chunk.choices[0].finish_reason or finish
                taps = (chunk.model_extra or {}).get("taps") or taps
                if hang_up and delta:
                    stream.close()
                    return Record(index, prompt, False, time.perf_counter() - start, ttft, text="".join(parts),
                                  outcome=outcome_of(None, hung_up=True))
            if chunk.usage is not None:
                usage = chunk.usage
        return Record(index, prompt, True, time.perf_counter() - start, ttft,
                      usage.completion_tokens if usage else 0, "".join(parts), finish, taps=taps)
    except Exception as err:
        outcome = outcome_of(err)
        return Record(index, prompt, False, time.perf_counter() - start, ttft, text="".join(parts),
                      error=f"{type(err).__name__}: {err}", outcome=outcome,
                      retry_after_s=retry_after_s(err) if outcome == "rejected_429" else None)


def one_request(client, model: str, index: int, prompt: int, args, hang_up: bool = False,
                deadline: float | None = None) -> Record:
    """A request until it is answered, hung up or fails: a 429 is retried after its ``Retry-After``
    while the run lasts (``deadline``; without one, for ``args.timeout`` seconds), each refusal counted
    (``refused_429``)."""
    start, refused = time.perf_counter(), 0
    deadline = deadline if deadline is not None else start + args.timeout
    while True:
        record = one_attempt(client, model, index, prompt, args, hang_up)
        if record.outcome != "rejected_429":
            break
        refused += 1
        if time.perf_counter() + record.retry_after_s > deadline:
            break
        time.sleep(record.retry_after_s)
    record.refused_429 = refused
    record.total_s = time.perf_counter() - start
    return record


def run(args) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=args.timeout)
    model = args.model or client.models.list().data[0].id
    records: list[Record] = []
    lock = threading.Lock()
    counter = iter(range(10 ** 9))
    fraction = getattr(args, "hangup_fraction", 0.0)
    hangups = hangup_plan(fraction, getattr(args, "hangup_seed", 0))
    start = time.perf_counter()
    deadline = start + args.duration if args.duration else None
    limit = args.requests if args.requests is not None else (None if args.duration else 64)

    def worker() -> None:
        while True:
            with lock:
                index = next(counter)
                hang_up = next(hangups)
            if (limit is not None and index >= limit) or (deadline is not None and time.perf_counter() > deadline):
                return
            record = one_request(client, model, index, index % len(prompt_set(args)), args, hang_up, deadline)
            with lock:
                records.append(record)
            if args.verbose:
                state = record.outcome if record.outcome != "error" else f"ERROR {record.error}"
                print(f"[{index}] {record.latency_s:.2f}s {record.completion_tokens} tok {state}", file=sys.stderr)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    steps = sum(r.taps.get("steps", 0) for r in ok)
    appended = sum(r.taps.get("tau", 0) * r.taps.get("steps", 0) for r in ok if r.taps.get("tau") is not None)
    outcomes = {name: sum(r.outcome == name for r in records) for name in OUTCOMES}
    summary = {
        "url": args.url, "model": model, "strategy": args.strategy, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "temperature": args.temperature, "hangup_fraction": fraction, "wall_s": wall,
        "requests": len(records), "ok": len(ok), "outcomes": outcomes, "errors": outcomes["error"],
        "refused_429": sum(r.refused_429 for r in records),
        "error_samples": sorted({r.error for r in records if r.outcome == "error"})[:10],
        "throughput_rps": len(ok) / wall if wall else None, "output_tokens_per_s": tokens / wall if wall else None,
        "completion_tokens": tokens, "latency_s": percentiles([r.latency_s for r in ok]),
        "latency_with_429_waits_s": percentiles([r.total_s for r in ok]),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tau": appended / steps if steps else None,
        "skipped_drafter_steps": sum(sum(sum(v.values()) for v in r.taps.get("skipped", {}).values()) for r in ok),
    }
    if args.verify:
        summary["verify"] = verify(args.verify, ok, args.max_tokens, [r for r in records if r.outcome == "hung_up"],
                                   prompts=prompt_set(args))
    return {"summary": summary, "records": [asdict(r) for r in sorted(records, key=lambda r: r.index)]}


def prompt_set(args) -> list[str]:
    """The prompts requests cycle through: ``args.prompt_texts`` when given, else :data:`PROMPTS`."""
    return getattr(args, "prompt_texts", None) or PROMPTS


def verify(config: str, records: list[Record], max_tokens: int, partial: list[Record] = (),
           overrides: list[str] = (), prompts: list[str] = PROMPTS) -> dict:
    """In-process vanilla greedy text per distinct prompt of ``prompts`` (the target of ``config`` with
    ``overrides``: the served one), the completed ``records`` that differ from it and the ``partial``
    (hung-up) ones whose text so far is not a prefix of it."""
    from taps_ray.config import load_config
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.decoder import generate

    target = TargetModel.load(load_config(config, list(overrides)).target)
    expected = {p: generate(target, [{"role": "user", "content": prompts[p]}], max_new_tokens=max_tokens).text
                for p in sorted({r.prompt for r in [*records, *partial]})}
    mismatched = [r.index for r in records if r.text != expected[r.prompt]]
    not_prefix = [r.index for r in partial if not expected[r.prompt].startswith(r.text)]
    return {"checked": len(records), "identical": len(records) - len(mismatched), "mismatched": mismatched,
            "partial_checked": len(partial), "partial_not_prefix": not_prefix}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests to send (default 64; with --duration: unlimited unless given)")
    parser.add_argument("--duration", type=float, default=None, help="stop starting requests after this many seconds")
    parser.add_argument("--strategy", default=None, help="taps strategy per request (default: the server's)")
    parser.add_argument("--model", default=None, help="model id (default: the server's first)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--hangup-fraction", type=float, default=0.0,
                        help="share of requests that close their stream after the first content chunk")
    parser.add_argument("--hangup-seed", type=int, default=0, help="seed of the RNG that picks them")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout (s)")
    parser.add_argument("--verify", default=None, metavar="CONFIG", help="compare with in-process greedy output")
    parser.add_argument("--out", default=None, help="JSON output path (default: stdout summary only)")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.concurrency < 1 or (args.requests is not None and args.requests < 1) or args.max_tokens < 1 \
            or (args.duration is not None and args.duration <= 0) or not 0 <= args.hangup_fraction <= 1:
        print("load_test: --concurrency, --requests, --duration and --max-tokens must be positive, "
              "--hangup-fraction in [0, 1]", file=sys.stderr)
        return 2
    result = run(args)
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if result["summary"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
