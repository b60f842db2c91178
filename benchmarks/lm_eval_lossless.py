"""Lossless, by a public harness: lm-eval (``pip install -e '.[bench]'``) scores GSM8K through ``taps serve``
with speculation and with ``vanilla``, answer for answer.

    python benchmarks/lm_eval_lossless.py --limit 50 --max-tokens 256 --strategy routed:confidence \
        --out runs/lm_eval_lossless [--config configs/demo.yaml] [--set KEY=VALUE ...] [--concurrent 1]

Writes a local lm-eval task (``task/gsm8k.jsonl``: ``--limit`` GSM8K test questions with their answers from
the project's pinned package-index wheel, leaving out every question a shipped release drafter trained on,
seeded subset 0; ``task/<run>/taps_gsm8k.yaml``: zero-shot, chat, greedy, lm-eval's GSM8K answer filters and
exact match), starts ``taps serve CONFIG target.dtype=float32`` on a free loopback port and runs ``lm-eval
run --model local-chat-completions`` against it twice, offline (no tokenizer, no hub): once with the
speculative ``--strategy`` and once with ``vanilla``, each asked per request (the ``taps`` extension in the
task's generation arguments). Every question's response, extracted answers and scores must be the same in
both runs, and so must the accuracy.

Output in ``--out``: ``lm_eval_lossless.json`` (per run: accuracy per filter, wall time, the lm-eval
command; the comparison), ``lm_eval/<run>/`` (lm-eval's results and ``--log_samples`` records and log),
``task/`` and ``serve.log``. Exit status 1 on any difference or failed run, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_process import REPO, free_port, get_json, start_server, stop  # noqa: E402

TASK = "taps_gsm8k"
RUNS = ("speculative", "vanilla")
FILTERS = ("strict-match", "flexible-extract")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
"""lm-eval's environment: the task data is a local file and requests are sent as text, nothing is fetched."""
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: {max_tokens}
  taps:
    strategy: "{strategy}"
num_fewshot: 0
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metadata:
  version: 1.0
"""
"""lm-eval's own GSM8K task (its answer filters and exact match), zero-shot on the local file, greedy,
``max_gen_toks`` and the request's ``taps.strategy`` filled in."""
STRATEGY_SERIES = re.compile(r'^\w*strategy_requests(?:_total)?\{[^}]*strategy="([^"]+)"[^}]*\}\s+(\S+)$', re.M)
"""A line of the server's ``taps_strategy_requests`` counter (finished requests by strategy)."""
DRAFTS_SERIES = re.compile(r'^\w*spec_decode_num_drafts(?:_total)?\{[^}]*\}\s+(\S+)$', re.M)
"""A line of the server's ``taps_spec_decode_num_drafts`` counter (verified draft trees)."""


def gsm8k_docs(limit: int, seed: int = 0) -> tuple[list[dict], str]:
    """``limit`` GSM8K test rows (``id``, ``question``, ``answer``) from the pinned wheel, none that a shipped
    release drafter trained on (a seeded subset in file order), and where they came from."""
    from taps_ray import artifacts
    from taps_ray.data.contamination import question_hashes, union_trained_prompts
    from taps_ray.data.json_records import JsonRecordReader
    from taps_ray.data.sources import seeded_subset
    from taps_ray.drafter_sources import release_names, resolve_drafter_dir

    path = artifacts.fetch("gsm8k_test")
    seen = union_trained_prompts([resolve_drafter_dir(f"release:{name}") for name in release_names()])
    rows = [{"id": index, "question": row["question"], "answer": row["answer"]}
            for index, (_, row) in enumerate(JsonRecordReader(path))]
    unseen = [row for row in rows if not question_hashes([row["question"]]) & seen]
    if len(unseen) < limit:
        raise ValueError(f"--limit {limit}: only {len(unseen)} of {len(rows)} GSM8K test questions are unseen "
                         "by the release drafters")
    pinned = artifacts.EMBEDDED["gsm8k_test"]
    origin = f"wheel {pinned.package}=={pinned.version}:{pinned.member}, {len(rows) - len(unseen)} trained-on left out"
    return [unseen[i] for i in seeded_subset(len(unseen), limit, seed)], origin


def write_task(folder: Path, data: Path, strategy: str, max_tokens: int) -> Path:
    """The task folder (``--include_path``) of one run: :data:`TASK_YAML` over ``data``."""
    folder.mkdir(parents=True, exist_ok=True)
    text = TASK_YAML.format(task=TASK, data=json.dumps(str(data.resolve())), max_tokens=max_tokens,
                            strategy=strategy)
    (folder / f"{TASK}.yaml").write_text(text)
    return folder


def lm_eval_command(url: str, model: str, tasks: Path, out: Path, limit: int, timeout_s: float,
                    concurrent: int) -> list[str]:
    """``lm-eval run`` of the local chat-completions model on the task in ``tasks``, requests sent as text
    (no tokenizer), samples logged."""
    model_args = (f"model={model},base_url={url}/v1/chat/completions,tokenizer_backend=None,"
                  f"tokenized_requests=False,num_concurrent={concurrent},max_retries=1,timeout={int(timeout_s)}")
    return [sys.executable, "-m", "lm_eval", "run", "--model", "local-chat-completions", "--model_args", model_args,
            "--tasks", TASK, "--include_path", str(tasks), "--apply_chat_template", "--limit", str(limit),
            "--log_samples", "--output_path", str(out)]


def read_samples(folder: Path) -> dict[int, dict]:
    """lm-eval's ``--log_samples`` records of :data:`TASK` under ``folder`` by ``doc_id``: the question, the
    response, and per filter the extracted answer and exact match. ValueError when there is no samples file,
    or a record lacks a field."""
    files = sorted(folder.rglob(f"samples_{TASK}_*.jsonl"))
    if not files:
        raise ValueError(f"no samples_{TASK}_*.jsonl under {folder}: did lm-eval run with --log_samples?")
    records: dict[int, dict] = {}
    for line_no, line in enumerate(files[-1].read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        try:
            doc_id, response = record["doc_id"], record["resps"][0][0]
            entry = records.setdefault(doc_id, {"question": record["doc"]["question"], "response": response,
                                                "filters": {}})
            entry["filters"][record["filter"]] = {"answer": record["filtered_resps"][0],
                                                  "exact_match": record["exact_match"]}
        except (KeyError, IndexError, TypeError) as err:
            raise ValueError(f"{files[-1]}:{line_no}: not an lm-eval sample record ({err!r})") from None
        if entry["response"] != response:
            raise ValueError(f"{files[-1]}:{line_no}: doc {doc_id} has two responses")
    return records


def accuracy(records: dict[int, dict]) -> dict[str, float | None]:
    """Mean exact match per filter over the records."""
    scores = {f: [r["filters"][f]["exact_match"] for r in records.values() if f in r["filters"]] for f in FILTERS}
    return {f: sum(s) / len(s) if s else None for f, s in scores.items()}


def compare(speculative: dict[int, dict], vanilla: dict[int, dict]) -> dict:
    """The two runs question by question: how many were compared and identical (same response, same answer
    and score under every filter), the differing ones, and the questions only one run has."""
    both = sorted(speculative.keys() & vanilla.keys())
    differing = [{"doc_id": d, "question": vanilla[d]["question"], "speculative": speculative[d]["response"],
                  "vanilla": vanilla[d]["response"]}
                 for d in both if speculative[d]["response"] != vanilla[d]["response"]
                 or speculative[d]["filters"] != vanilla[d]["filters"]]
    return {"compared": len(both), "identical": len(both) - len(differing), "differing": differing,
            "only_speculative": sorted(speculative.keys() - vanilla.keys()),
            "only_vanilla": sorted(vanilla.keys() - speculative.keys()),
            "accuracy": {"speculative": accuracy(speculative), "vanilla": accuracy(vanilla)}}


def failures(comparison: dict, expected: int) -> list[str]:
    """Why the check fails: fewer questions than ``expected`` compared, a question in one run only, a
    differing response or score, a differing accuracy. Empty when it passes."""
    found = []
    if comparison["compared"] < expected:
        found.append(f"{comparison['compared']} questions compared, expected {expected}")
    for run in RUNS:
        if comparison[f"only_{run}"]:
            found.append(f"questions only in the {run} run: {comparison[f'only_{run}']}")
    if comparison["differing"]:
        first = comparison["differing"][0]
        found.append(f"{len(comparison['differing'])} of {comparison['compared']} answers differ, e.g. doc "
                     f"{first['doc_id']}: speculative {first['speculative']!r} vs vanilla {first['vanilla']!r}")
    acc = comparison["accuracy"]
    if acc["speculative"] != acc["vanilla"]:
        found.append(f"accuracy differs: speculative {acc['speculative']} vs vanilla {acc['vanilla']}")
    return found


def served_counts(metrics_text: str) -> dict:
    """From the server's ``/metrics`` text: finished requests by strategy and verified draft trees."""
    strategies: dict[str, float] = {}
    for strategy, value in STRATEGY_SERIES.findall(metrics_text):
        strategies[strategy] = strategies.get(strategy, 0.0) + float(value)
    return {"strategies": strategies, "draft_trees": sum(float(v) for v in DRAFTS_SERIES.findall(metrics_text))}


def served_delta(before: dict, after: dict) -> dict:
    """What the server did between two :func:`served_counts`: requests by strategy, draft trees."""
    strategies = {k: v - before["strategies"].get(k, 0.0) for k, v in after["strategies"].items()}
    return {"strategies": {k: int(v) for k, v in strategies.items() if v},
            "draft_trees": int(after["draft_trees"] - before["draft_trees"])}


def read_served(url: str) -> dict:
    """:func:`served_counts` of the server at ``url``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        return served_counts(response.read().decode())


def served_failures(run: str, strategy: str, served: dict, questions: int) -> list[str]:
    """Why a run did not decode as asked: its requests were not all served with ``strategy`` (a strategy name
    as the server reports it), or the speculative run verified no draft tree, or vanilla did."""
    found = []
    if served["strategies"] != {strategy: questions}:
        found.append(f"{run}: the server finished {served['strategies']} requests by strategy, expected "
                     f"{{{strategy!r}: {questions}}}")
    if (strategy == "vanilla") != (served["draft_trees"] == 0):
        found.append(f"{run}: {served['draft_trees']} draft trees verified with strategy {strategy!r}")
    return found


def run_lm_eval(cmd: list[str], log: Path, cache: str, within_s: float) -> float:
    """One lm-eval run (offline, its datasets cache in ``cache``); its wall time in seconds. RuntimeError when
    it fails or overruns."""
    env = {**os.environ, **OFFLINE_ENV, "HF_DATASETS_CACHE": cache}
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(within_s)
        except subprocess.TimeoutExpired:
            stop(proc, grace_s=30)
            raise RuntimeError(f"lm-eval overran {within_s:g} s; see {log}") from None
    if code != 0:
        raise RuntimeError(f"lm-eval exited {code}; see {log}")
    return time.monotonic() - start


def markdown(summary: dict) -> str:
    """The result table: per run, accuracy under both filters and wall time; then the comparison."""
    lines = ["| run | strategy | questions | exact match (flexible-extract) | exact match (strict-match) | wall s |",
             "|---|---|---|---|---|---|"]
    for run in summary["runs"]:
        acc = {f: "-" if v is None else f"{v:.3f}" for f, v in run["accuracy"].items()}
        lines.append(f"| {run['run']} | {run['strategy']} | {run['questions']} | {acc['flexible-extract']} "
                     f"| {acc['strict-match']} | {run['wall_s']:.0f} |")
    comparison = summary["comparison"]
    if comparison:
        lines.append(f"\nanswer for answer: {comparison['identical']}/{comparison['compared']} identical")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml", help="the served config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the server (repeatable; target.dtype=float32 is always set)")
    parser.add_argument("--strategy", default="routed:confidence", help="the speculative strategy compared with "
                        "vanilla (any the server resolves: single, routed:confidence, merged, ...)")
    parser.add_argument("--limit", type=int, default=50, help="GSM8K test questions")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per answer at most")
    parser.add_argument("--concurrent", type=int, default=1, help="requests lm-eval sends at once")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /ready")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    if min(args.limit, args.max_tokens, args.concurrent) < 1 or args.timeout <= 0:
        print("lm_eval_lossless: --limit, --max-tokens, --concurrent and --timeout must be positive, got "
              f"{args.limit}, {args.max_tokens}, {args.concurrent}, {args.timeout:g}", file=sys.stderr)
        return 2
    from taps_ray.spec.strategy import parse_strategy

    try:
        spec_name = parse_strategy(args.strategy).name
        if parse_strategy(args.strategy).kind == "vanilla":
            raise ValueError("--strategy must be a speculative strategy, got vanilla (the reference run)")
    except ValueError as err:
        print(f"lm_eval_lossless: {err}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("lm_eval") is None:
        print("lm_eval_lossless: lm-eval is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "lm_eval").mkdir(parents=True, exist_ok=True)
    try:
        docs, origin = gsm8k_docs(args.limit)
    except ValueError as err:
        print(f"lm_eval_lossless: {err}", file=sys.stderr)
        return 2
    data = out / "task" / "gsm8k.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    overrides = [*args.overrides, "target.dtype=float32"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runs: list[dict] = []
    aborted: list[str] = []
    start = time.monotonic()
    server = start_server(args.config, overrides, port, out / "serve.log", args.ready_timeout,
                          app_name="taps-lm-eval")
    try:
        model = get_json(f"{url}/v1/models", timeout=60)["data"][0]["id"]
        with tempfile.TemporaryDirectory(prefix="lm_eval_hf_") as cache:
            for run, strategy, name in zip(RUNS, (args.strategy, "vanilla"), (spec_name, "vanilla")):
                tasks = write_task(out / "task" / run, data, strategy, args.max_tokens)
                cmd = lm_eval_command(url, model, tasks, out / "lm_eval" / run, args.limit, args.timeout,
                                      args.concurrent)
                print(f"lm_eval_lossless: {run} ({strategy}), {len(docs)} questions", file=sys.stderr)
                try:
                    before = read_served(url)
                    wall = run_lm_eval(cmd, out / "lm_eval" / f"{run}.log", cache,
                                       len(docs) * args.timeout + 300)
                    records = read_samples(out / "lm_eval" / run)
                    served = served_delta(before, read_served(url))
                except (OSError, RuntimeError, ValueError) as err:
                    aborted.append(f"{run}: {err}")
                    break
                aborted += served_failures(run, name, served, len(docs))
                runs.append({"run": run, "strategy": strategy, "questions": len(records),
                             "accuracy": accuracy(records), "wall_s": round(wall, 1), "served": served,
                             "command": " ".join(cmd), "records": records})
                print(f"lm_eval_lossless: {run}: accuracy {runs[-1]['accuracy']}, {wall:.0f} s", file=sys.stderr)
    finally:
        stop(server)
    comparison = compare(runs[0]["records"], runs[1]["records"]) if len(runs) == 2 else None
    found = aborted + (failures(comparison, len(docs)) if comparison else [])
    summary = {"config": args.config, "overrides": overrides, "model": model, "strategy": args.strategy,
               "max_tokens": args.max_tokens, "questions": len(docs), "question_ids": [d["id"] for d in docs],
               "origin": origin, "concurrent": args.concurrent, "wall_s": round(time.monotonic() - start, 1),
               "runs": [{k: v for k, v in r.items() if k != "records"} for r in runs],
               "comparison": comparison, "failures": found}
    (out / "lm_eval_lossless.json").write_text(json.dumps(summary, indent=1))
    print(markdown(summary))
    for line in found:
        print(f"lm_eval_lossless: FAIL {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
