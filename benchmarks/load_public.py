"""A public load generator (guidellm, ``pip install -e '.[bench]'``) against a real ``taps serve``.

    python benchmarks/load_public.py --rates 0.25,0.5,1,2,4,8 --requests 40 --max-tokens 64 \
        --out runs/load_public [--config configs/demo.yaml] [--set KEY=VALUE ...] [--prompts 16] [--require-429]

Decodes ``--prompts`` GSM8K questions in-process (vanilla greedy on the config's target: the reference),
starts ``taps serve CONFIG`` (a subprocess on a free loopback port with its own local Ray cluster, ``--set``
overrides applied to it and to the reference) and waits for ``/ready``, then runs ``guidellm run`` once per
rate, lowest first: ``--requests`` streamed greedy chat completions (temperature 0, ``--max-tokens``) at
that constant rate, offline (the target's local tokenizer, the prompts in a local JSONL file). Every
answered (200) request's text must equal the reference; the only error allowed is 429.

Output in ``--out``: ``load_public.json`` (per rate: status counts, identical answers, guidellm's TTFT, ITL,
TPOT and end-to-end latency p50/p90/p99, throughput, the guidellm command), ``load_public.md`` (the
table), ``guidellm/`` (guidellm's own JSON reports and logs) and ``serve.log``. Exit status 1 on any error
other than 429, any request left incomplete or any answer that differs (with ``--require-429``: also when
the highest rate saw no 429), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_process import REPO, free_port, get_json, start_server, stop  # noqa: E402

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "GUIDELLM__MAX_WORKER_PROCESSES": "2"}
"""guidellm's environment: the tokenizer and the data are local files, nothing is fetched; two client
processes (its default is ten, which on a small machine compete with the server they measure)."""
LATENCIES = {"ttft_ms": "time_to_first_token_ms", "itl_ms": "inter_token_latency_ms",
             "tpot_ms": "time_per_output_token_ms", "e2e_s": "request_latency"}
"""Report name: guidellm metric (over the successful requests)."""
QUANTILES = ("p50", "p90", "p99")
HTTP_STATUS = re.compile(r"'(\d{3}) [^']*' for url")
"""The status code in httpx's ``HTTPStatusError`` message (guidellm records ``repr(error)``)."""


def parse_rates(text: str) -> list[float]:
    """``"0.25,0.5,1"`` as ascending positive request rates; ValueError otherwise."""
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(not rate > 0 for rate in rates) or rates != sorted(set(rates)):
        raise ValueError(f"rates must be positive and strictly rising, got {text!r}")
    return rates


def status_of(error: str | None) -> str:
    """A request's outcome from guidellm's error string: ``"200"`` (none), the HTTP status of a refused
    request (``"429"``, ``"500"`` ...) or ``"error"`` (anything else: an error event in a 200 stream, a
    dropped connection, a timeout)."""
    if error is None:
        return "200"
    match = HTTP_STATUS.search(error)
    return match.group(1) if match else "error"


def prompt_of(request_args: str | None) -> str | None:
    """The user text of the chat request guidellm sent (its ``request_args`` JSON), or None."""
    if not request_args:
        return None
    messages = json.loads(request_args).get("body", {}).get("messages") or []
    if not messages:
        return None
    content = messages[-1].get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content


def compare(answers: list[tuple[str | None, str | None]], expected: dict[str, str]) -> dict:
    """Each answered ``(prompt, text)`` against the in-process greedy text of its prompt: how many were
    checked and identical, and the differing ones (a prompt without a reference counts as differing)."""
    mismatched = [{"prompt": prompt, "served": text, "expected": expected.get(prompt or "")}
                  for prompt, text in answers if prompt not in expected or (text or "") != expected[prompt]]
    return {"checked": len(answers), "identical": len(answers) - len(mismatched), "mismatched": mismatched}


def summarize(report: dict, expected: dict[str, str]) -> dict:
    """One rate's figures from guidellm's JSON ``report`` (one benchmark): status counts, the comparison
    with ``expected``, latency percentiles of the successful requests, throughput."""
    bench = report["benchmarks"][0]
    requests = bench["requests"]
    statuses: dict[str, int] = {}
    errors: dict[str, str] = {}
    for request in [*requests["successful"], *requests["errored"]]:
        status = status_of(request["info"]["error"])
        statuses[status] = statuses.get(status, 0) + 1
        if status not in ("200", "429"):
            errors.setdefault(status, request["info"]["error"])
    ok = requests["successful"]
    metrics = bench["metrics"]
    latency = {name: {q: metrics[key]["successful"]["percentiles"][q] if ok else None for q in QUANTILES}
               for name, key in LATENCIES.items()}
    tokens = sum(r["output_metrics"]["text_tokens"] or 0 for r in ok)
    duration = bench["duration"]
    sent = len(requests["successful"]) + len(requests["errored"]) + len(requests["incomplete"])
    return {
        "rate": bench["config"]["strategy"]["rate"], "sent": sent,
        "unsent": max(0, int(bench.get("scheduler_state", {}).get("created_requests", sent)) - sent),
        "statuses": dict(sorted(statuses.items())),
        "incomplete": len(requests["incomplete"]), "error_samples": errors,
        "answers": compare([(prompt_of(r["request_args"]), r["output"]) for r in ok], expected),
        "latency": latency, "duration_s": duration,
        "throughput_rps": len(ok) / duration if duration else None,
        "output_tokens_per_s": tokens / duration if duration else None,
    }


def failures(rates: list[dict], require_429: bool = False) -> list[str]:
    """Why the run fails: errors other than 429, incomplete requests, differing answers and (with
    ``require_429``) no 429 at the highest rate. Empty when it passes."""
    found = []
    for r in rates:
        other = {k: v for k, v in r["statuses"].items() if k not in ("200", "429")}
        if other:
            found.append(f"rate {r['rate']:g}: errors other than 429: {other} {r['error_samples']}")
        if r["incomplete"]:
            found.append(f"rate {r['rate']:g}: {r['incomplete']} requests incomplete")
        if r.get("unsent"):
            found.append(f"rate {r['rate']:g}: guidellm created {r['unsent']} request(s) it never sent (its "
                         f"scheduler cancelled them before they started)")
        if r["answers"]["mismatched"]:
            found.append(f"rate {r['rate']:g}: {len(r['answers']['mismatched'])} answers differ from in-process "
                         f"greedy decoding, e.g. {r['answers']['mismatched'][0]}")
    if require_429 and rates and not rates[-1]["statuses"].get("429"):
        found.append(f"no 429 at the highest rate ({rates[-1]['rate']:g} req/s): not past capacity")
    return found


def markdown(rates: list[dict]) -> str:
    """The per-rate table: status counts, identical answers, latency percentiles (p50 / p90 / p99)."""

    def trio(values: dict, scale: float = 1.0, digits: int = 0) -> str:
        return " / ".join("-" if values[q] is None else f"{values[q] * scale:.{digits}f}" for q in QUANTILES)

    lines = ["| rate (req/s) | sent | 200 | 429 | other | identical | TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 "
             "| TPOT ms p50/p90/p99 | end-to-end s p50/p90/p99 | answered req/s | output tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rates:
        st, lat = r["statuses"], r["latency"]
        other = sum(v for k, v in st.items() if k not in ("200", "429")) + r["incomplete"]
        lines.append(
            f"| {r['rate']:g} | {r['sent']} | {st.get('200', 0)} | {st.get('429', 0)} | {other} "
            f"| {r['answers']['identical']}/{r['answers']['checked']} | {trio(lat['ttft_ms'])} | {trio(lat['itl_ms'])} "
            f"| {trio(lat['tpot_ms'])} | {trio(lat['e2e_s'], digits=2)} | {r['throughput_rps']:.2f} "
            f"| {r['output_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def gsm8k_prompts(n: int) -> list[str]:
    """The first turns of ``n`` GSM8K test questions (the project's own benchmark loader, seed 0)."""
    from taps_ray.data.benchmarks import load_benchmark

    return [q.turns[0] for q in load_benchmark("gsm8k", limit=n, seed=0)]


def reference(config: str, overrides: list[str], prompts: list[str], max_tokens: int) -> tuple[dict[str, str], str]:
    """In-process vanilla greedy text of every prompt on the config's target (``overrides`` applied: the
    served one), and the local folder of its tokenizer."""
    from taps_ray.config import load_config
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.decoder import generate

    target = TargetModel.load(load_config(config, overrides).target)
    texts = {p: generate(target, [{"role": "user", "content": p}], max_new_tokens=max_tokens).text for p in prompts}
    return texts, target.tokenizer.name_or_path


def guidellm_command(url: str, model: str, rate: float, requests: int, max_tokens: int, data: Path,
                     tokenizer: str, out: Path, timeout_s: float) -> list[str]:
    """``guidellm run`` of ``requests`` streamed greedy chat completions at a constant ``rate``."""
    backend = (f"kind=openai_http,target={url},model={model},max_tokens={max_tokens},http2=false,"
               f"timeout={timeout_s:g},extras.body.temperature=0")
    return [sys.executable, "-m", "guidellm", "run", "--backend", backend,
            "--profile", f"kind=constant,rate={rate:g}", "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=json_file,path={data}", "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]


def run_rate(cmd: list[str], log: Path, cache: str, within_s: float) -> None:
    """One guidellm run (offline, its datasets cache in ``cache``); RuntimeError when it fails or overruns."""
    env = {**os.environ, **OFFLINE_ENV, "HF_DATASETS_CACHE": cache}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(within_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise RuntimeError(f"guidellm overran {within_s:g} s; see {log}") from None
    if code != 0:
        raise RuntimeError(f"guidellm exited {code}; see {log}")


def measure_rate(cmd: list[str], report: Path, log: Path, cache: str, within_s: float, expected: dict[str, str],
                 tries: int = 2) -> dict:
    """One rate's summary from a guidellm run; run again (up to ``tries`` runs in all) while guidellm left
    requests unsent (its scheduler, under load, can cancel a request before it starts and drop it from
    the report: nothing the server did). RuntimeError when guidellm fails or overruns."""
    for attempt in range(tries):
        print(f"load_public: {cmd[cmd.index('--profile') + 1]}, {cmd[cmd.index('--constraint') + 1]}"
              f"{' (again: guidellm left requests unsent)' if attempt else ''}", file=sys.stderr)
        run_rate(cmd, log, cache, within_s)
        result = summarize(json.loads(report.read_text()), expected)
        if not result["unsent"]:
            break
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml", help="the served config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the server and the reference (repeatable)")
    parser.add_argument("--rates", default="0.25,0.5,1,2,4,8", help="constant request rates (req/s), rising")
    parser.add_argument("--requests", type=int, default=40, help="requests per rate")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16, help="distinct GSM8K questions the requests cycle over")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /ready")
    parser.add_argument("--require-429", action="store_true", help="fail when the highest rate saw no 429")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    try:
        rates = parse_rates(args.rates)
    except ValueError as err:
        print(f"load_public: {err}", file=sys.stderr)
        return 2
    if min(args.requests, args.max_tokens, args.prompts) < 1 or args.timeout <= 0:
        print("load_public: --requests, --max-tokens, --prompts and --timeout must be positive", file=sys.stderr)
        return 2
    if importlib.util.find_spec("guidellm") is None:
        print("load_public: guidellm is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "guidellm").mkdir(parents=True, exist_ok=True)
    prompts = gsm8k_prompts(args.prompts)
    expected, tokenizer = reference(args.config, args.overrides, prompts, args.max_tokens)
    data = out / "guidellm" / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompts[i % len(prompts)]}) + "\n" for i in range(args.requests)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    results: list[dict] = []
    aborted: list[str] = []
    server = start_server(args.config, args.overrides, port, out / "serve.log", args.ready_timeout)
    try:
        model = get_json(f"{url}/v1/models", timeout=60)["data"][0]["id"]
        with tempfile.TemporaryDirectory(prefix="load_public_hf_") as cache:
            for rate in rates:
                report = out / "guidellm" / f"rate_{rate:g}.json"
                cmd = guidellm_command(url, model, rate, args.requests, args.max_tokens, data, tokenizer, report,
                                       args.timeout)
                try:
                    result = measure_rate(cmd, report, out / "guidellm" / f"rate_{rate:g}.log", cache,
                                          args.requests / rate + args.timeout + 300, expected)
                except RuntimeError as err:
                    aborted.append(f"rate {rate:g}: {err}")
                    break
                results.append({**result, "command": " ".join(cmd)})
                print(f"load_public: rate {rate:g}: {result['statuses']}, identical "
                      f"{result['answers']['identical']}/{result['answers']['checked']}", file=sys.stderr)
    finally:
        stop(server)
    found = aborted + failures(results, args.require_429)
    summary = {"config": args.config, "overrides": args.overrides, "model": model, "max_tokens": args.max_tokens,
               "requests_per_rate": args.requests, "prompts": len(prompts), "tokenizer": tokenizer,
               "identical": sum(r["answers"]["identical"] for r in results),
               "checked": sum(r["answers"]["checked"] for r in results),
               "first_429_rate": next((r["rate"] for r in results if r["statuses"].get("429")), None),
               "failures": found, "rates": results}
    (out / "load_public.json").write_text(json.dumps(summary, indent=1))
    (out / "load_public.md").write_text(markdown(results))
    print(markdown(results))
    for line in found:
        print(f"load_public: FAIL {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
