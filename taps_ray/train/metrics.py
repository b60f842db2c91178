"""Held-out drafter metrics: greedy unrolled top-1 accuracy per draft position and simulated tau.

Draft position ``k`` at drafter position ``t`` is the depth-``k`` chain state of
:func:`taps_ray.train.losses.drafter_passes` without noise: target features up to ``t - k + 1``,
then ``k - 1`` steps on the drafter's own features, fed the teacher-forced tokens. It is correct
when the drafter's argmax equals the target's argmax at ``t`` (``argmax head(f_{t+1})``, the token
greedy (T=0) verification would accept there, which may differ from the dataset token
``x_{t+2}``). Positions are counted as in the loss: the ``k`` chain nodes ``x_{t-k+2}..x_{t+1}``
are real assistant tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from taps_ray.train.losses import align_batch, chain_scored, drafter_passes, unwrap


@torch.no_grad()
def unrolled_counts(drafter: nn.Module, batch: dict, embed: nn.Embedding | torch.Tensor,
                    lm_head_weight: torch.Tensor, depth: int) -> tuple[list[int], list[int]]:
    """(correct[k-1], total[k-1]) for draft positions k = 1..``depth`` over one batch (to sum
    over several batches before dividing)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    inputs = align_batch(batch, embed, drafter)
    outputs = drafter_passes(drafter, inputs.token_embeds, inputs.features, inputs.positions, depth)
    head = lm_head_weight.detach()
    module = unwrap(drafter)
    scored = inputs.scored
    targets = inputs.targets[scored]
    target_top1 = F.linear(targets, head.to(targets.dtype)).argmax(-1)
    correct: list[int] = []
    total: list[int] = []
    for k, out in enumerate(outputs, start=1):
        chain = chain_scored(scored, k)
        draft_top1 = module.to_target_ids(module.logits(out[chain], head).argmax(-1))
        correct.append(int((draft_top1 == target_top1[chain[scored]]).sum()))
        total.append(int(chain.sum()))
    return correct, total


def unrolled_accuracy(drafter: nn.Module, batch: dict, embed: nn.Embedding | torch.Tensor,
                      lm_head_weight: torch.Tensor, depth: int) -> list[float]:
    """Top-1 accuracy per draft position k = 1..``depth`` (NaN where no position qualifies)."""
    correct, total = unrolled_counts(drafter, batch, embed, lm_head_weight, depth)
    return [c / t if t else float("nan") for c, t in zip(correct, total)]


def simulated_tau(acc: Sequence[float]) -> float:
    """Expected acceptance length of a chain: ``1 + sum_k prod_{j<=k} acc_j``."""
    tau, survive = 1.0, 1.0
    for a in acc:
        survive *= float(a)
        tau += survive
    return tau
