"""Training stages and the learning-rate schedule: stage 1 over ``train.epochs`` and, for HASS with
``train.stage2``, a second stage at its own peak learning rate and top-K weight; within a stage, linear
warmup then cosine, linear or constant decay, a function of the step alone (a resumed run needs no state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from taps_ray.config import TrainConfig


@dataclass(frozen=True)
class Stage:
    """A training stage: epochs ``[first_epoch, first_epoch + epochs)`` at peak ``lr``;
    ``topk_weight`` overrides the objective's when not None."""

    first_epoch: int
    epochs: int
    lr: float
    topk_weight: float | None = None


def plan_stages(train: TrainConfig, algorithm: str) -> list[Stage]:
    """Stage 1 (``train.epochs`` at ``train.lr``) and, for HASS with ``stage2``, stage 2."""
    stages = [Stage(0, train.epochs, train.lr)]
    if algorithm == "hass" and train.stage2 is not None:
        s2 = train.stage2
        stages.append(Stage(train.epochs, s2.epochs, s2.lr, s2.topk_weight))
    return stages


def stage_of(stages: list[Stage], epoch: int) -> Stage:
    return next(s for s in stages if s.first_epoch <= epoch < s.first_epoch + s.epochs)


def lr_at(step: int, stage_steps: int, peak: float, warmup: int, schedule: str) -> float:
    """Learning rate of the stage's ``step``-th update (0-based) out of ``stage_steps``: linear
    warmup to ``peak`` over ``warmup`` updates, then cosine/linear decay towards 0 or constant."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = (step - warmup) / max(1, stage_steps - warmup)
    if schedule == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (1.0 - progress)
