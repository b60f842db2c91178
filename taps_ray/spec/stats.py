"""Per-step records and the one definition of tau, per-depth acceptance and entropy summaries.

A step is one target verification; it appends its accepted draft tokens plus the bonus token,
trimmed after EOS and at ``max_new_tokens``. The first token (from the prefill) is not a step.
tau = appended tokens / steps over a set of steps (micro average); ``tau_per_question`` is the
mean of per-question tau. Per-depth acceptance at depth d is the fraction of steps with accepted
length >= d among steps with accepted length >= d - 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

_NAN = float("nan")


@dataclass
class StepRecord:
    """One verification step.

    ``accepted`` draft tokens accepted (before trimming), ``appended`` tokens kept after trimming,
    ``tree_size`` verified nodes including the root (1 for plain decoding), ``tree_depth`` its
    deepest level (0-dim tensor or int; 0 for plain decoding), ``draft_s`` /
    ``verify_s`` wall seconds. Entropies (nats): ``draft_entropy`` [k] / ``target_entropy`` [k] of
    the draft and target (temperature 1) distributions each accepted token was drawn from /
    verified against; ``rejected_*`` the same for the rejected token (the first tried child at the
    first failing depth), NaN when the accepted path ended at a leaf. Tensors are kept as tensors
    until summarised so the decode loop never syncs for them. ``meta`` holds strategy decisions.
    """

    accepted: int
    appended: int
    tree_size: int
    draft_s: float
    verify_s: float
    tree_depth: torch.Tensor | int = 0
    draft_entropy: torch.Tensor | None = None
    target_entropy: torch.Tensor | None = None
    rejected_draft_entropy: torch.Tensor | None = None
    rejected_target_entropy: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    @property
    def rejected(self) -> bool:
        """Whether a draft token was rejected at depth ``accepted + 1``."""
        value = self.rejected_draft_entropy
        return value is not None and not math.isnan(float(value))

    def outcome(self) -> list[bool]:
        """Per-depth outcome from depth 1: True accepted, False rejected (absent: no draft tried)."""
        return [True] * self.accepted + ([False] if self.rejected else [])

    def to_dict(self) -> dict:
        def plain(value):
            if isinstance(value, torch.Tensor):
                return value.tolist()
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value

        return {k: plain(v) for k, v in asdict(self).items()}


def tau(records: Sequence[StepRecord]) -> float:
    """Appended tokens per step (NaN without steps)."""
    return sum(r.appended for r in records) / len(records) if records else _NAN


def per_depth_acceptance(accept_lengths: Sequence[int], max_depth: int | None = None) -> list[float]:
    """Entry d-1: share of steps with accepted length >= d among those with >= d - 1.

    Runs for d = 1 .. ``max_depth`` (the deepest tree drafted), stopping early where undefined.
    """
    out = []
    reached = len(accept_lengths)
    depth = 1
    max_depth = max(accept_lengths, default=0) + 1 if max_depth is None else max_depth
    while reached and depth <= max_depth:
        passed = sum(1 for a in accept_lengths if a >= depth)
        out.append(passed / reached)
        reached, depth = passed, depth + 1
    return out


def _mean(values: list[torch.Tensor]) -> float:
    values = [v.reshape(-1) for v in values if v is not None]
    flat = torch.cat(values) if values else torch.empty(0)
    flat = flat[~flat.isnan()]
    return float(flat.mean()) if flat.numel() else _NAN


@dataclass
class SpecMetrics:
    """Summary of many generations (one list of steps per question)."""

    questions: int
    steps: int
    tokens: int
    tau: float
    tau_per_question: float
    per_depth_acceptance: list[float]
    accept_length_counts: list[int]
    mean_tree_size: float
    draft_s: float
    verify_s: float
    entropy: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(per_question: Sequence[Sequence[StepRecord]]) -> SpecMetrics:
    """Aggregate step records of several questions with the definitions of this module."""
    records = [r for steps in per_question for r in steps]
    lengths = [r.accepted for r in records]
    counts = [0] * (max(lengths, default=-1) + 1)
    for a in lengths:
        counts[a] += 1
    taus = [tau(steps) for steps in per_question if steps]
    return SpecMetrics(
        questions=len(per_question),
        steps=len(records),
        tokens=sum(r.appended for r in records),
        tau=tau(records),
        tau_per_question=sum(taus) / len(taus) if taus else _NAN,
        per_depth_acceptance=per_depth_acceptance(lengths, max((int(r.tree_depth) for r in records), default=0)),
        accept_length_counts=counts,
        mean_tree_size=sum(r.tree_size for r in records) / len(records) if records else _NAN,
        draft_s=sum(r.draft_s for r in records),
        verify_s=sum(r.verify_s for r in records),
        entropy={
            "accepted_draft": _mean([r.draft_entropy for r in records]),
            "accepted_target": _mean([r.target_entropy for r in records]),
            "rejected_draft": _mean([r.rejected_draft_entropy for r in records]),
            "rejected_target": _mean([r.rejected_target_entropy for r in records]),
        },
    )
