"""An evaluation worker: the target, the drafters and one strategy object per strategy, loaded once;
it runs units (one question at one temperature, every strategy still missing for it, back to back)
and turns each strategy's generations into one JSON-ready record.

A question's turns run as one conversation: turn 2 is asked after the strategy's own answer to turn 1
(MT-Bench). Each turn's sampling seed depends only on the question, the turn and the run's seed.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from taps_ray.config import SamplingConfig, TargetConfig, TreeConfig
from taps_ray.data.benchmarks import BenchmarkQuestion
from taps_ray.eval.plan import EvalError, EvalPlan
from taps_ray.models.drafter import DraftHead
from taps_ray.models.target import TargetModel
from taps_ray.spec import stats
from taps_ray.spec.batch import generate_together
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.decoder import GenerationResult, generate, load_drafter_source, prompt_ids


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



@dataclass
class Unit:
    """One question at one temperature, the strategies still to run on it with the plan's tree, and those
    still to run with its production tree."""

    question: BenchmarkQuestion
    temperature: float
    strategies: list[str]
    production: list[str] = field(default_factory=list)


class EvalWorker:
    """Holds the target, the drafters and one strategy object per strategy; runs units.

    ``target_factory`` (picklable, no arguments) replaces ``TargetModel.load(plan.target)``.
    """

    def __init__(self, plan: EvalPlan, target_factory: Callable[[], TargetModel] | None = None, warmup: bool = True):
        if plan.threads:
            torch.set_num_threads(plan.threads)
        self.plan = plan
        self.target = target_factory() if target_factory else TargetModel.load(TargetConfig(**plan.target))
        self.drafters: dict[str, DraftHead] = {
            name: load_drafter_source(self.target, name, source) for name, source in plan.drafters.items()}
        self.strategies = self._build(plan.tree)
        self.production = self._build(plan.production_tree, skip_vanilla=True) if plan.production_tree else {}
        if warmup:
            ids = torch.arange(2, 10, device=self.target.device) % self.target.vocab_size
            for strategy in [*self.strategies.values(), *self.production.values()]:
                generate(self.target, ids, strategy, None, 3, collect_entropy=True)
                if getattr(strategy, "tree_budget", None) is not None:
                    strategy.tree_budget = strategy.tree_budget.fresh()

    def _build(self, tree: dict, skip_vanilla: bool = False) -> dict:
        """One strategy object per plan strategy, drafting with ``tree``."""
        cfg = TreeConfig(**tree)
        return {name: build_strategy(name, {n: self.drafters[n] for n in self.plan.drafters_of(name)}, cfg,
                                     probe_steps=self.plan.probe_steps, recheck_every=self.plan.recheck_every)
                for name in self.plan.strategies if not (skip_vanilla and name == "vanilla")}

    def run(self, unit: Unit) -> list[dict]:
        """Records of ``unit``'s strategies, in order, then of its production runs. With production runs (method
        ``both``) the speed table times those, so the paper-tree runs other than vanilla decode together, one
        batched verification forward per step (:func:`~taps_ray.spec.batch.generate_together`): what they
        measure -- tokens, acceptance, entropy, depth -- does not depend on timing or on batching (the engine's
        rows are batch-invariant), and their records say ``batched`` (how many decoded together), untimed."""
        together = [name for name in unit.strategies if name != "vanilla"] if self.production else []
        if len(together) < 2:
            together = []
        runs = [(name, self.strategies[name], self.plan.method) for name in unit.strategies]
        runs += [(name, self.production[name], "production") for name in unit.production]
        decoded = self._decode_together(unit, [self.strategies[name] for name in together]) if together else []
        batched = dict(zip(together, decoded))
        records = []
        for name, strategy, method in runs:
            if method != "production" and name in batched:
                results, prompts = batched[name]
            else:
                results, prompts = self._decode(unit, [strategy])[0]
            record = make_record(unit.question, name, self.plan.drafters_of(name), unit.temperature, results)
            record["method"] = method
            if method != "production" and name in batched:
                record["batched"] = len(together)
            budget = getattr(strategy, "tree_budget", None)
            if budget is not None and budget.cost is not None:
                record["cost_model"] = budget.cost.describe()
            record["worker"] = os.getpid()
            record["prompt_ids"] = prompts
            record["output_ids"] = [r.token_ids for r in results]
            records.append(record)
        return records

    def _sampling(self, unit: Unit, turn: int) -> SamplingConfig:
        return SamplingConfig(temperature=unit.temperature, top_p=self.plan.top_p, top_k=self.plan.top_k,
                              seed=sampling_seed(unit.question, turn, self.plan.seed))

    def _decode(self, unit: Unit, strategies: list) -> list[tuple[list[GenerationResult], list[list[int]]]]:
        """Each strategy's (results per turn, prompt ids per turn) of ``unit``'s question, one after another."""
        out = []
        for strategy in strategies:
            results: list[GenerationResult] = []
            prompts: list[list[int]] = []
            for turn in range(len(unit.question.turns)):
                ids = conversation_ids(self.target, unit.question.turns[:turn + 1], results)
                prompts.append(ids.tolist())
                results.append(generate(self.target, ids, strategy, self._sampling(unit, turn),
                                        self.plan.max_new_tokens))
            out.append((results, prompts))
        return out

    def _decode_together(self, unit: Unit, strategies: list) -> list[tuple[list[GenerationResult], list[list[int]]]]:
        """As :meth:`_decode`, every strategy's turn decoded in one batch."""
        results: list[list[GenerationResult]] = [[] for _ in strategies]
        prompts: list[list[list[int]]] = [[] for _ in strategies]
        for turn in range(len(unit.question.turns)):
            ids = [conversation_ids(self.target, unit.question.turns[:turn + 1], done) for done in results]
            for held, prompt in zip(prompts, ids):
                held.append(prompt.tolist())
            answers, _ = generate_together(self.target, ids, strategies, [self._sampling(unit, turn)] * len(ids),
                                           max_batch=len(ids), wait_s=0.05, max_new_tokens=self.plan.max_new_tokens)
            for done, answer in zip(results, answers):
                done.append(answer)
        return list(zip(results, prompts))
