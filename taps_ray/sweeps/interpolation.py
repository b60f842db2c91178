"""Interpolation sweep trials: average K drafters of one target in weight space and measure tau.

A trial (one Tune actor with the spec's ``eval_cpus``, + 1 GPU with ``use_gpu``) loads the target
and the drafters once per actor (actors are reused across trials), averages them with the trial's
weights (``alpha, 1 - alpha`` or a weight vector), saves the averaged drafter under
``<out>/trials/<trial_id>/drafter`` and reports tau per domain on the held-out prompts and the
objective. ``alpha = 1`` is the first drafter itself, ``alpha = 0`` the second (the paper's Figure 6).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from taps_ray.config import TreeConfig
from taps_ray.data.contamination import write_averaged
from taps_ray.drafter_sources import resolve_drafter_dir
from taps_ray.models.drafter import DraftHead, average_drafters
from taps_ray.spec.compose import check_drafters
from taps_ray.spec.decoder import load_drafter_source
from taps_ray.sweeps.config import InterpolationSweepSpec
from taps_ray.sweeps.trial import TrialContext, cached_target, domain_taus, tau_metrics

_DRAFTERS: dict[tuple, DraftHead] = {}


@dataclass(kw_only=True)
class InterpolationContext(TrialContext):
    """Everything an interpolation trial needs, resolved on the driver: the trial basics, the spec and
    the drafters averaged (name -> absolute folder or ``random:SEED``)."""

    spec: InterpolationSweepSpec
    drafters: dict[str, str]


def load_source(target, name: str, source: str) -> DraftHead:
    """The drafter of ``source`` (a checkpoint folder, or ``random:SEED``), cached per process."""
    key = (target.name, name, source)
    if key not in _DRAFTERS:
        _DRAFTERS[key] = load_drafter_source(target, name, source)
    return _DRAFTERS[key]


def interpolation_trial(config: dict, context: InterpolationContext) -> None:
    """One Tune trial: average, save, evaluate, report (see module docstring)."""
    from ray import tune

    started = time.time()
    folder, attempt = context.begin(config)
    if context.threads:
        torch.set_num_threads(context.threads)
    target = cached_target(context.target)
    names = list(context.drafters)
    heads = [load_source(target, name, context.drafters[name]) for name in names]
    check_drafters(heads, names, target)
    weights = context.spec.weights_of(config)
    merged = average_drafters(heads, weights)
    merged.metadata.update(name=f"{context.spec.name}-{folder.name}",
                           averaged_from={n: context.drafters[n] for n in names}, weights=weights)
    drafter_dir = merged.save(folder / "drafter", target.fingerprint)
    write_averaged(drafter_dir, [resolve_drafter_dir(source) for source in context.drafters.values()])
    taus = domain_taus(target, merged, context.prompts, TreeConfig(**context.tree), context.spec.eval.max_new_tokens)
    metrics = tau_metrics(taus)
    tune.report({
        **metrics,
        "objective": context.spec.objective.value({d: t.tau for d, t in taus.items()}),
        "weights": weights,
        "drafter": str(drafter_dir),
        "attempt": attempt,
        "wall_s": time.time() - started,
        "evaluated": True,
    })
