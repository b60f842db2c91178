"""How drafting runs the drafter and its LM head (:class:`DraftCompute`): the drafter's forward over its
own cache and the draft-vocabulary log-probabilities of its outputs, directly (:data:`DIRECT`) or through
a batcher that several sessions drafting at once share (:class:`taps_ray.spec.batch.DraftBatcher`), with
the same results; the LM-head rows of a drafter's draft vocabulary, computed once per drafter and head.

Shapes: ``n`` new positions, ``P`` cached positions, ``H`` hidden size, ``V`` draft vocabulary.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from taps_ray.models.drafter import DraftHead
from taps_ray.models.quant import HalfLinear


class DraftCompute:
    """How :func:`~taps_ray.spec.tree.draft_tree` runs the drafter and its LM head: directly (this class,
    :data:`DIRECT`), or through a batcher that several sessions drafting at once share
    (:class:`taps_ray.spec.batch.DraftBatcher`), with the same results."""

    def forward(self, drafter: DraftHead, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: DynamicCache, mask: torch.Tensor | None) -> torch.Tensor:
        """``drafter(embeds [1, n, H], features [1, n, H], positions [1, n], cache, mask [1, 1, n, P + n] or
        None)`` -> [1, n, H]; ``cache`` is extended by n entries."""
        return drafter(embeds, features, positions, cache, mask)

    def log_probs(self, head: torch.Tensor | HalfLinear, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`draft_log_probs` of ``hidden`` [n, H] under ``head`` [V, H]."""
        return draft_log_probs(head, hidden)


DIRECT = DraftCompute()


def draft_head_rows(drafter: DraftHead, weight: torch.Tensor, half: bool = False) -> torch.Tensor | HalfLinear:
    """The LM-head rows [V_draft, H] of ``drafter``'s draft vocabulary in the target head ``weight`` [V, H]
    (``weight`` itself for the whole vocabulary); computed once per drafter and head and shared by its sessions.
    ``half``: those rows as a :class:`~taps_ray.models.quant.HalfLinear` product, for a target that reads its
    own weights in half precision (``target.weights: fp16``): the draft head is the target's head, read in the
    target's format (4-10x float32's ``mm`` for the few rows drafted at once on the CPUs measured)."""
    cached: tuple[torch.Tensor, torch.Tensor, dict[str, HalfLinear]] | None = drafter.__dict__.get("_head_rows")
    if cached is None or cached[0] is not weight:
        rows = weight if drafter.draft_to_target is None else weight[drafter.draft_to_target]
        cached = (weight, rows, {})
        drafter.__dict__["_head_rows"] = cached
    if not half:
        return cached[1]
    if "half" not in cached[2]:
        cached[2]["half"] = HalfLinear(cached[1], None)
    return cached[2]["half"]


def draft_log_probs(head: torch.Tensor | HalfLinear, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    """Draft log-probs [n, V], their entropies [n] and log-normalisers [n] from drafter outputs
    ``hidden`` [n, H].

    ``head`` [V, H] is the (draft-vocabulary) LM head, or its half-precision product
    (:func:`draft_head_rows`); for a tensor, ``head @ hidden^T`` is the faster float32 CPU kernel for the few
    rows drafted at a time (the weight read dominates).
    """
    if isinstance(head, HalfLinear):
        logits = head(hidden.float())
    else:
        logits = (head @ hidden.to(head.dtype).T).T.float().contiguous()
    logp = torch.log_softmax(logits, dim=-1)
    return logp, -(logp.exp() * logp).sum(-1), logits.amax(-1) - logp.amax(-1)
