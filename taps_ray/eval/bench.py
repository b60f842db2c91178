"""Decode-speed benchmark of one target on the same prompts, in one run.

Methods: ``vanilla`` (our plain decoding through ``TargetModel.forward``), ``hf-greedy`` (HF
``generate``), ``hf-prompt-lookup`` (HF prompt-lookup decoding), ``spec`` (our speculative
decoding with one drafter) and optional peers (``llamacpp``: :mod:`taps_ray.eval.peers`). Methods run interleaved prompt by prompt so background load hits them
alike. Each run is timed twice: wall clock (the real speed) and process CPU time, which other
load on a shared machine barely inflates when torch runs one thread (with more threads CPU time
sums over them). Speedups are ratios to ``vanilla``; ``match`` is the share of prompts whose greedy
output equals vanilla token for token. The optional sweep varies ``total_tokens`` and ``depth``
and reports the break-even tau (spec step CPU time / vanilla step CPU time): a tree pays only
where the drafter's tau exceeds it; :func:`pick_tree` names the fastest tree for this drafter here.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import GenerationConfig

from taps_ray.config import SamplingConfig, TreeConfig
from taps_ray.eval.exactness import ExactnessReport, account
from taps_ray.eval.intervals import speedup_interval
from taps_ray.eval.peers import peer_method
from taps_ray.models.drafter import DraftHead
from taps_ray.models.target import TargetModel
from taps_ray.runstate import atomic_write
from taps_ray.spec import stats
from taps_ray.spec.cost import CostModel, TreeBudget, cost_model
from taps_ray.spec.decoder import generate, greedy_steps, prompt_ids
from taps_ray.spec.machine import engine_label
from taps_ray.spec.protocol import SingleStrategy

PROMPT_LOOKUP_TOKENS = 10
PEER_NOTE = "speed reference: the GGUF's own low-bit kernels, not an exactness row"
NAN = float("nan")


@dataclass
class Run:
    """One generation: generated ``tokens``, ``seconds`` wall and ``cpu_seconds`` process time of the
    whole call (prefill included), verification ``steps`` (target forwards after the prefill) and
    our per-step records (times in CPU seconds) when available. Every token but the first (from the
    prefill) was appended by a step."""

    tokens: list[int]
    seconds: float
    cpu_seconds: float
    steps: int
    records: list[stats.StepRecord] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return stats.acceptance_length(len(self.tokens) - 1, self.steps)


Method = Callable[[torch.Tensor], Run]


def _timed(call: Callable[[], object]) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = call()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def ours(target: TargetModel, make_strategy: Callable[[], object], max_new_tokens: int,
         sampling: SamplingConfig | None = None, cost: CostModel | None = None) -> Method:
    """Our decoder with a fresh strategy per prompt (greedy unless ``sampling``; with ``cost``, one
    :class:`~taps_ray.spec.cost.TreeBudget` across the prompts, as a server keeps one per strategy); step
    records in CPU time. ``reset()`` on the returned method forgets what the budget observed (after a warm-up)."""
    budget = TreeBudget(cost) if cost is not None else None

    def run(ids: torch.Tensor) -> Run:
        result, wall, cpu = _timed(lambda: generate(target, ids, make_strategy(), sampling, max_new_tokens,
                                                    collect_entropy=False, timer=time.process_time, budget=budget))
        return Run(result.token_ids, wall, cpu, len(result.steps), result.steps)

    def reset() -> None:
        nonlocal budget
        budget = budget.fresh() if budget is not None else None

    run.reset = reset
    return run


def hf_generate(target: TargetModel, max_new_tokens: int, prompt_lookup: int | None = None) -> Method:
    """HF ``generate`` greedy (``prompt_lookup`` = ``prompt_lookup_num_tokens`` for prompt lookup).

    Steps are counted with a forward hook on the model (calls minus the prefill).
    """
    eos = sorted(target.eos_token_ids)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0] if eos else 0, prompt_lookup_num_tokens=prompt_lookup)

    def run(ids: torch.Tensor) -> Run:
        calls = [0]

        def count(*_):
            calls[0] += 1

        hook = target.model.register_forward_hook(count)
        try:
            with torch.inference_mode():
                out, wall, cpu = _timed(lambda: target.model.generate(
                    input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], generation_config=config))
        finally:
            hook.remove()
        return Run(out[0, ids.numel():].tolist(), wall, cpu, calls[0] - 1)

    return run


@dataclass
class MethodRow:
    """Totals of one method over the prompts; ``step_cpu_ms`` from our step records (draft + verify)."""

    method: str
    prompts: int
    tokens: int
    seconds: float
    cpu_seconds: float
    tokens_per_s: float
    tokens_per_cpu_s: float
    tau: float
    tau_per_question: float
    steps: int
    step_cpu_ms: float
    speedup: float = NAN
    cpu_speedup: float = NAN
    speedup_low: float = NAN
    speedup_high: float = NAN
    match: float = NAN
    note: str = ""


def summarize_runs(method: str, runs: list[Run], note: str = "") -> MethodRow:
    tokens = sum(len(r.tokens) for r in runs)
    seconds, cpu = sum(r.seconds for r in runs), sum(r.cpu_seconds for r in runs)
    steps = sum(r.steps for r in runs)
    records = [rec for r in runs for rec in r.records]
    step_ms = 1e3 * sum(rec.draft_s + rec.verify_s for rec in records) / len(records) if records else NAN
    return MethodRow(method, len(runs), tokens, seconds, cpu, tokens / seconds, tokens / cpu,
                     stats.acceptance_length(sum(len(r.tokens) - 1 for r in runs), steps),
                     stats.mean_tau(r.tau for r in runs), steps, step_ms, note=note)


@dataclass
class BenchReport:
    settings: dict
    methods: list[MethodRow]
    sweep: list[dict] = field(default_factory=list)
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    exactness: ExactnessReport | None = None

    def to_dict(self) -> dict:
        return {"settings": self.settings, "methods": [asdict(m) for m in self.methods], "sweep": self.sweep,
                "picked_tree": pick_tree(self.sweep), "outputs": self.outputs,
                "exactness": self.exactness.to_dict() if self.exactness else None}

    def to_markdown(self) -> str:
        s = self.settings
        lines = [
            f"# Decode benchmark: {s['target']} on {s['benchmark']}",
            "",
            f"{s['prompts']} prompts, {s['max_new_tokens']} new tokens max, {s.get('sampling', 'greedy')}, "
            f"{s['dtype']} on {s['device']}, "
            f"{s['threads']} torch threads, load average {s['load_before']} -> {s['load_after']}; "
            f"drafter: {s['drafter']}; tree: {s['tree']}. CPU columns use process time (robust to other "
            f"load with one torch thread).",
            "",
            *([f"Engine: {s['engine']}. Vanilla: {s['vanilla_ms_per_token']} ms per token (wall, prefill included) "
               f"against a weight-read floor of {s['weight_read_ms']} ms ({s['weight_mb']} MB at {s['read_gb_per_s']} "
               f"GB/s, measured in this run): {s['vanilla_vs_floor']}x the floor.", ""] if "engine" in s else []),
            *([f"Compiled steps: {s['compiled_graphs']} graphs compiled in {s['compile_s']} s (at first use, during "
               f"the cost model's measurement or the warm-up; outside every timed run).", ""]
              if "compile_s" in s else []),
            *([f"Cost model (spec-cost): {s['cost_model']}.", ""] if "cost_model" in s else []),
            "| method | tokens | tok/s | speedup [95% CI over prompts, paired] | tok/CPU-s | CPU speedup | tau | tau (per question) "
            "| step CPU ms | match vanilla | note |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for m in self.methods:
            bounds = "" if m.speedup_low != m.speedup_low else f" [{m.speedup_low:.2f}, {m.speedup_high:.2f}]"
            lines.append(f"| {m.method} | {m.tokens} | {m.tokens_per_s:.2f} | {m.speedup:.2f}x{bounds} | "
                         f"{m.tokens_per_cpu_s:.2f} | {m.cpu_speedup:.2f}x | {_fmt(m.tau)} | "
                         f"{_fmt(m.tau_per_question)} | {_fmt(m.step_cpu_ms, 1)} | {'-' if m.match != m.match else f'{m.match:.0%}'} | {m.note} |")
        if self.exactness is not None:
            lines += ["", "## Exactness", "", self.exactness.to_markdown()]
        if self.sweep:
            lines += [
                "",
                "## Tree sweep (spec strategy)",
                "",
                "A tree pays when its drafter's tau exceeds the break-even tau = spec step CPU time / vanilla "
                "step CPU time (vanilla interleaved with the trees; times are CPU ms per step).",
                "",
                "| depth | top_k | total_tokens | lookup_tokens | tau | tok/s | speedup | CPU speedup | draft ms "
                "| verify ms | vanilla ms | break-even tau |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for row in self.sweep:
                lines.append(f"| {row['depth']} | {row['top_k']} | {row['total_tokens']} | "
                             f"{row.get('lookup_tokens', 0)} | {_fmt(row['tau'])} | "
                             f"{row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | {row['cpu_speedup']:.2f}x | "
                             f"{row['draft_ms']:.1f} | {row['verify_ms']:.1f} | {row['vanilla_ms']:.1f} | "
                             f"{row['break_even_tau']:.2f} |")
            best = pick_tree(self.sweep)
            lines += ["", f"Fastest tree for this drafter here: `tree.depth={best['depth']} tree.top_k={best['top_k']} "
                          f"tree.total_tokens={best['total_tokens']} tree.lookup_tokens={best.get('lookup_tokens', 0)}` "
                          f"(CPU speedup {best['cpu_speedup']:.2f}x, tau "
                          f"{_fmt(best['tau'])}, break-even tau {best['break_even_tau']:.2f})."]
        return "\n".join(lines) + "\n"


def weight_read_floor(target: TargetModel, repeats: int = 10) -> dict:
    """The memory-bandwidth floor of a plain step: the fastest of ``repeats`` passes that read every weight of
    the target once in the format its forward reads (the static engine's int4 codes where it runs them; a sum
    per tensor, tied tensors once): ``{"weight_mb", "read_ms", "gb_per_s"}``."""
    tensors = target.engine.step_tensors(target.lm_head) if target.engine is not None else target.model.parameters()
    params = list({id(p): p for p in tensors}.values())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    words = [_as_float32(p) for p in params]  # every format summed as float32 words: the read, not the arithmetic
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 2):
            start = time.perf_counter()
            for w in words:
                w.sum()
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            best = min(best, time.perf_counter() - start)
    return {"weight_mb": round(nbytes / 1e6, 1), "read_ms": round(1e3 * best, 2), "gb_per_s": round(nbytes / best / 1e9, 1)}


def _as_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes read as float32 words where its layout allows (else the tensor itself)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_contiguous() and (flat.numel() * flat.element_size()) % 4 == 0:
        try:
            return flat.view(torch.uint8).view(torch.float32)
        except RuntimeError:
            return flat
    return flat


def tree_note(tree: TreeConfig) -> str:
    note = f"depth={tree.depth} top_k={tree.top_k} total_tokens={tree.total_tokens}"
    return note + (f" lookup_tokens={tree.lookup_tokens}" if tree.lookup_tokens else "")


def pick_tree(sweep: list[dict]) -> dict | None:
    """The sweep row with the highest CPU speedup over vanilla (this drafter's tau against this
    machine's step costs); None for an empty sweep."""
    return max(sweep, key=lambda row: row["cpu_speedup"], default=None)


def _fmt(value: float, digits: int = 2) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


def benchmark_prompts(target: TargetModel, benchmark: str, limit: int, seed: int = 0,
                      exclude: set[str] | None = None) -> list[torch.Tensor]:
    """Chat-templated first turns [T] of ``limit`` questions of ``benchmark``, drawn after dropping the
    questions whose prompt hashes are in ``exclude`` (:mod:`taps_ray.data.contamination`)."""
    from taps_ray.data.benchmarks import load_benchmark

    questions = load_benchmark(benchmark, limit=limit, seed=seed, exclude=exclude)
    return [prompt_ids(target, q.turns[0]) for q in questions]


def drafter_tau(target: TargetModel, drafter: DraftHead, tree: TreeConfig, benchmark: str, limit: int,
                max_new_tokens: int, exclude: set[str] | None = None) -> dict:
    """Greedy tau of ``drafter`` with ``tree`` on ``limit`` questions of ``benchmark`` (those in
    ``exclude`` dropped first): ``{"benchmark", "questions", "tau", "max_new_tokens"}``."""
    prompts = benchmark_prompts(target, benchmark, limit, exclude=exclude)
    steps = [s for question in greedy_steps(target, drafter, prompts, tree, max_new_tokens) for s in question]
    return {"benchmark": benchmark, "questions": len(prompts), "tau": round(stats.tau(steps), 3),
            "max_new_tokens": max_new_tokens}


def run_methods(prompts: list[torch.Tensor], methods: dict[str, Method], desc: str = "bench") -> dict[str, list[Run]]:
    """Run every method on every prompt, interleaved prompt by prompt, after one short warm-up each (which a
    method with a ``reset`` then forgets)."""
    runs: dict[str, list[Run]] = {name: [] for name in methods}
    for method in methods.values():
        method(prompts[0][:8])
        getattr(method, "reset", lambda: None)()
    for ids in tqdm(prompts, desc=desc, unit="prompt"):
        for name, method in methods.items():
            runs[name].append(method(ids))
    return runs


def run_bench(
    target: TargetModel,
    prompts: list[torch.Tensor],
    drafter: DraftHead,
    tree: TreeConfig,
    max_new_tokens: int,
    hf: bool = True,
    sweep_total: list[int] | None = None,
    sweep_depth: list[int] | None = None,
    sweep_lookup: list[int] | None = None,
    settings: dict | None = None,
    sampling: SamplingConfig | None = None,
    reference: TargetModel | None = None,
    peers: list[str] | None = None,
) -> BenchReport:
    """Vanilla, HF greedy, HF prompt lookup, ``spec`` (one drafter, ``tree``) and each of ``peers``
    (:mod:`taps_ray.eval.peers`: other engines as speed references, greedy only) on ``prompts``.

    Greedy runs are accounted for exactness (:mod:`taps_ray.eval.exactness`) against vanilla, with
    ``reference`` (a float32 copy of ``target``) measuring the gaps when ``target`` is not float32.
    With ``sampling`` at T > 0 only vanilla and spec run (their outputs are draws, not compared).
    """
    load_before = round(os.getloadavg()[0], 2)
    greedy = sampling is None or sampling.temperature == 0
    methods: dict[str, Method] = {"vanilla": ours(target, lambda: None, max_new_tokens, sampling)}
    if hf and greedy:
        methods["hf-greedy"] = hf_generate(target, max_new_tokens)
        methods["hf-prompt-lookup"] = hf_generate(target, max_new_tokens, PROMPT_LOOKUP_TOKENS)
    methods["spec"] = ours(target, lambda: SingleStrategy(drafter, tree), max_new_tokens, sampling)
    notes = {"hf-prompt-lookup": f"prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS}", "spec": tree_note(tree)}
    cost = cost_model(target)
    methods["spec-cost"] = ours(target, lambda: SingleStrategy(drafter, tree), max_new_tokens, sampling, cost)
    notes["spec-cost"] = "the same tree as an upper bound, sized per step by the cost model"
    for name in (peers or []) if greedy else []:
        methods[name] = peer_method(name, target, max_new_tokens)
        notes[name] = "; ".join(filter(None, [f"{PEER_NOTE}, {torch.get_num_threads()} threads",
                                              getattr(methods[name], "note", "")]))
    runs = run_methods(prompts, methods)
    rows = [summarize_runs(name, method_runs, notes.get(name, "")) for name, method_runs in runs.items()]
    base = rows[0]
    for row in rows:
        row.speedup = row.tokens_per_s / base.tokens_per_s
        row.cpu_speedup = row.tokens_per_cpu_s / base.tokens_per_cpu_s
        if row is not base:
            row.speedup_low, row.speedup_high = speedup_interval([np.array(
                [[len(a.tokens), a.seconds, len(v.tokens), v.seconds] for a, v in zip(runs[row.method], runs["vanilla"])])])
        if greedy:
            row.match = sum(a.tokens == b.tokens for a, b in zip(runs[row.method], runs["vanilla"])) / len(prompts)

    sweep = []
    if sweep_total or sweep_depth or sweep_lookup:
        sweep = run_sweep(target, prompts, drafter, tree, max_new_tokens, sweep_total or [tree.total_tokens],
                          sweep_depth or [tree.depth], sweep_lookup or [tree.lookup_tokens])
    info = _bench_info(target, tree, len(prompts), max_new_tokens, sampling, cost, runs["vanilla"], load_before,
                       settings)
    outputs = {name: [r.tokens for r in method_runs] for name, method_runs in runs.items()}
    ours_only = {name: tokens for name, tokens in outputs.items() if name not in (peers or [])}
    exactness = account(target, reference, prompts, ours_only) if greedy else None
    return BenchReport(info, rows, sweep, outputs, exactness)


def _bench_info(target: TargetModel, tree: TreeConfig, prompts: int, max_new_tokens: int,
                sampling: SamplingConfig | None, cost: CostModel, vanilla: list[Run], load_before: float,
                settings: dict | None) -> dict:
    """The report's header: the sampling, target, machine and its load average before (``load_before``) and
    now, ``settings``, the cost model, the engine, and ``vanilla``'s (runs) ms per token against the
    target's weight-read floor."""
    greedy = sampling is None or sampling.temperature == 0
    sampling_note = ("greedy" if greedy else f"sampling T={sampling.temperature} top_p={sampling.top_p} "
                     f"top_k={sampling.top_k} seed={sampling.seed}")
    info = {
        "sampling": sampling_note, "target": target.name, "device": str(target.device), "dtype": target.precision,
        "threads": torch.get_num_threads(), "prompts": prompts, "max_new_tokens": max_new_tokens,
        "tree": tree_note(tree),
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_before": load_before, "load_after": round(os.getloadavg()[0], 2), **(settings or {}),
    }
    floor = weight_read_floor(target)
    plain_ms = 1e3 * sum(r.seconds for r in vanilla) / max(1, sum(r.steps + 1 for r in vanilla))
    info.update(cost_model=cost.describe(), engine=engine_label(target.engine) if target.engine is not None else "hf", weight_mb=floor["weight_mb"],
                weight_read_ms=floor["read_ms"], read_gb_per_s=floor["gb_per_s"], vanilla_ms_per_token=round(plain_ms, 2),
                vanilla_vs_floor=round(plain_ms / floor["read_ms"], 2))
    compiled = getattr(target.engine, "compiled", None)
    if compiled is not None:
        info.update(compiled_graphs=compiled.compiles, compile_s=round(compiled.compile_s, 1))
    return info


def run_sweep(target: TargetModel, prompts: list[torch.Tensor], drafter: DraftHead, tree: TreeConfig,
              max_new_tokens: int, totals: list[int], depths: list[int], lookups: list[int] | None = None) -> list[dict]:
    """tau, speed and break-even tau of the spec strategy for each (depth, total_tokens, lookup_tokens).

    Vanilla runs interleaved with the trees; per-step costs are CPU ms (mean over all steps) and
    break-even tau = (draft + verify) / vanilla step.
    """
    grid = [tree.model_copy(update={"depth": d, "total_tokens": n, "lookup_tokens": m})
            for d in depths for n in totals for m in (lookups or [tree.lookup_tokens])]
    methods: dict[str, Method] = {"vanilla": ours(target, lambda: None, max_new_tokens)}
    for cfg in grid:
        methods[f"d{cfg.depth}-n{cfg.total_tokens}-l{cfg.lookup_tokens}"] = ours(target, lambda cfg=cfg: SingleStrategy(drafter, cfg),
                                                             max_new_tokens)
    runs = run_methods(prompts, methods, desc="sweep")

    def mean_ms(method_runs: list[Run], part: Callable[[stats.StepRecord], float]) -> float:
        records = [rec for r in method_runs for rec in r.records]
        return 1e3 * sum(part(rec) for rec in records) / len(records)

    base = summarize_runs("vanilla", runs["vanilla"])
    vanilla_ms = mean_ms(runs["vanilla"], lambda rec: rec.draft_s + rec.verify_s)
    rows = []
    for cfg, name in zip(grid, list(methods)[1:]):
        row = summarize_runs(name, runs[name])
        draft_ms, verify_ms = mean_ms(runs[name], lambda rec: rec.draft_s), mean_ms(runs[name], lambda rec: rec.verify_s)
        rows.append({
            "depth": cfg.depth, "top_k": cfg.top_k, "total_tokens": cfg.total_tokens,
            "lookup_tokens": cfg.lookup_tokens, "tau": row.tau,
            "tokens_per_s": row.tokens_per_s, "speedup": row.tokens_per_s / base.tokens_per_s,
            "cpu_speedup": row.tokens_per_cpu_s / base.tokens_per_cpu_s, "draft_ms": draft_ms,
            "verify_ms": verify_ms, "vanilla_ms": vanilla_ms, "break_even_tau": (draft_ms + verify_ms) / vanilla_ms,
        })
    return rows


def write_report(report: BenchReport, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``bench.json`` and ``bench.md`` into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "bench.json", out / "bench.md"
    for path, text in ((json_path, json.dumps(report.to_dict(), indent=1, default=str)), (md_path, report.to_markdown())):
        atomic_write(path, text)
    return json_path, md_path
