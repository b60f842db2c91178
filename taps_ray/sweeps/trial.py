"""What every sweep trial shares: tau on held-out prompts with the core decoder, attempt records,
failure injection, and a per-process cache of loaded targets.

Failure injection (tests, drills): ``$TAPS_SWEEP_FAIL`` (read by the driver, :func:`taps_ray.runtime.faults.trial_fault`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from taps_ray.config import TargetConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.models.target import TargetModel
from taps_ray.runstate import append_jsonl, read_jsonl
from taps_ray.runtime import faults
from taps_ray.spec import stats
from taps_ray.spec.decoder import greedy_steps

ATTEMPTS = "attempts.jsonl"
_TARGETS: dict[str, TargetModel] = {}


@dataclass(kw_only=True)
class TrialContext:
    """What every trial needs, resolved on the driver: ``target``, the :class:`TargetConfig` dump tau is
    measured with; ``prompts``, domain -> held-out prompt token ids; the ``tree``; the sweep folder
    ``out_dir``; torch ``threads``; the fault to inject (``fail``, :func:`taps_ray.runtime.faults.trial_fault`)."""

    target: dict
    prompts: dict[str, list[list[int]]]
    tree: dict
    out_dir: str
    threads: int | None
    fail: str | None = None

    def begin(self, config: dict) -> tuple[Path, int]:
        """Start the running Tune trial of ``config``: its folder ``<out_dir>/trials/<trial id>`` and its
        attempt number (recorded there), after injecting the configured fault."""
        from ray import tune

        folder = Path(self.out_dir) / "trials" / tune.get_context().get_trial_id()
        attempt = record_attempt(folder)
        faults.trial_fault(self.fail, config)
        return folder, attempt


@dataclass
class DomainTau:
    """Speculative decoding of one domain's prompts: tau and tau per question as :mod:`taps_ray.spec.stats`
    defines them (NaN without steps)."""

    tau: float
    tau_per_question: float
    steps: int
    appended: int
    prompts: int


def cached_target(target: dict) -> TargetModel:
    """The target of ``target`` (a :class:`TargetConfig` dump), loaded once per process."""
    key = json.dumps(target, sort_keys=True)
    if key not in _TARGETS:
        _TARGETS[key] = TargetModel.load(TargetConfig(**target))
    return _TARGETS[key]


def domain_taus(target: TargetModel, drafter: DraftHead, prompts: dict[str, list[list[int]]], tree: TreeConfig,
                max_new_tokens: int) -> dict[str, DomainTau]:
    """Greedy speculative decoding of every prompt (token ids) with ``drafter``'s EAGLE-2 tree, fixed in size
    (``tree.adaptive`` off: a trial's tau must not follow the machine's timings)."""
    out = {}
    for domain, items in prompts.items():
        per_question = greedy_steps(target, drafter, items, tree, max_new_tokens)
        steps = [s for question in per_question for s in question]
        out[domain] = DomainTau(
            tau=stats.tau(steps), tau_per_question=stats.mean_tau(stats.tau(q) for q in per_question),
            steps=len(steps), appended=sum(s.appended for s in steps), prompts=len(items))
    return out


def tau_metrics(taus: dict[str, DomainTau]) -> dict[str, float]:
    """Flat metrics ``tau/<domain>``, ``tau_per_question/<domain>``, ``steps/<domain>``."""
    metrics: dict[str, float] = {}
    for domain, result in taus.items():
        metrics[f"tau/{domain}"] = result.tau
        metrics[f"tau_per_question/{domain}"] = result.tau_per_question
        metrics[f"steps/{domain}"] = result.steps
    return metrics


def evaluate_checkpoint(target: dict, drafter_dir: str, prompts: dict[str, list[list[int]]], tree: dict,
                        max_new_tokens: int, threads: int | None) -> dict[str, float]:
    """:func:`tau_metrics` of the drafter checkpoint in ``drafter_dir`` (run as a Ray task)."""
    if threads:
        torch.set_num_threads(threads)
    model = cached_target(target)
    head = DraftHead.load(drafter_dir, model.config, model.fingerprint, model.device, model.dtype)
    return tau_metrics(domain_taus(model, head, prompts, TreeConfig(**tree), max_new_tokens))


def record_attempt(folder: Path) -> int:
    """Append this attempt of a trial to ``folder/attempts.jsonl``; return its number (1-based)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ATTEMPTS
    append_jsonl(path, [{"time": time.time(), "pid": os.getpid()}])
    return len(read_jsonl(path))


def count_attempts(folder: Path) -> int:
    return len(read_jsonl(folder / ATTEMPTS))

