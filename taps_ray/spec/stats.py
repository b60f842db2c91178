"""Per-step records and the one definition of tau, per-depth acceptance and entropy summaries.

A step is one target verification; it appends its accepted draft tokens plus the bonus token,
trimmed after EOS, at ``max_new_tokens`` and after the token that completes a stop sequence (the decode
loop trims them). The first token (from the prefill) is not a step.
tau = appended tokens / steps over a set of steps (micro average, :func:`acceptance_length`);
``tau_per_question`` is the mean of per-question tau (:func:`mean_tau`).

Per depth d = 1 .. D (the deepest tree drafted) a step either accepted a draft token at d, had its
token at d rejected, or ended at a leaf at depth d - 1 (no draft token to try at d; a plain step
ends at the root, depth 0). Per-depth acceptance at d is accepted / (accepted + rejected) at d
(:class:`DepthCounts`); steps that ended at a leaf are counted apart, never as rejections.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

_NAN = float("nan")


@dataclass
class StepRecord:
    """One verification step.

    ``accepted`` draft tokens accepted (before trimming), ``appended`` tokens kept after trimming,
    ``tree_size`` verified nodes including the root (1 for plain decoding), ``tree_depth`` its
    deepest level (0-dim tensor or int; 0 for plain decoding), ``rejected`` whether a draft token
    was tried and rejected at depth ``accepted + 1`` (0-dim bool tensor or bool; False when the
    accepted path ended at a leaf or the step was plain), ``draft_s`` /
    ``verify_s`` wall seconds. Entropies (nats): ``draft_entropy`` [k] / ``target_entropy`` [k] of
    the draft and target (temperature 1) distributions each accepted token was drawn from /
    verified against; ``rejected_*`` the same for the rejected token (the first tried child at the
    first failing depth), NaN when the accepted path ended at a leaf. Tensors are kept as tensors
    until summarised so the decode loop never syncs for them. ``shed``: nodes cut from the proposed tree
    to fit the step's node limit; ``load_plain``: the limit made the step plain without drafting. ``meta``
    holds strategy decisions (the tree's meta and the strategy's step notes, ``DecodeState.notes``).
    """

    accepted: int
    appended: int
    tree_size: int
    draft_s: float
    verify_s: float
    tree_depth: torch.Tensor | int = 0
    rejected: torch.Tensor | bool = False
    draft_entropy: torch.Tensor | None = None
    target_entropy: torch.Tensor | None = None
    rejected_draft_entropy: torch.Tensor | None = None
    rejected_target_entropy: torch.Tensor | None = None
    shed: int = 0
    load_plain: bool = False
    meta: dict = field(default_factory=dict)

    def outcome(self) -> list[bool]:
        """This step's :func:`step_outcome`."""
        return step_outcome(self.accepted, bool(self.rejected))

    def to_dict(self) -> dict:
        def plain(value):
            if isinstance(value, torch.Tensor):
                return value.tolist()
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value

        return {k: plain(v) for k, v in asdict(self).items()}


def step_outcome(accepted: int, rejected: bool) -> list[bool]:
    """Per-depth outcome of a step from depth 1: True per accepted depth, then False when the token at
    the next depth was rejected; no entry there when the accepted path ended at a leaf."""
    return [True] * accepted + ([False] if rejected else [])


def acceptance_length(appended: int, steps: int) -> float:
    """tau of totals: ``appended`` tokens over ``steps`` verification steps (NaN without steps)."""
    return appended / steps if steps else _NAN


def tau(records: Sequence[StepRecord]) -> float:
    """Appended tokens per step of ``records`` (NaN without steps)."""
    return acceptance_length(sum(r.appended for r in records), len(records))


def mean_tau(taus: Iterable[float | None]) -> float:
    """``tau_per_question``: the mean of per-question taus; questions without steps (None or NaN) are
    left out (NaN when none is left)."""
    values = [t for t in taus if t is not None and not math.isnan(t)]
    return sum(values) / len(values) if values else _NAN


@dataclass
class DepthCounts:
    """Step outcomes per draft depth d = 1 .. D (entry d - 1 of each list).

    ``accepted``: steps that accepted a draft token at d; ``rejected``: steps whose draft token at d
    was rejected; ``leaf``: steps whose accepted path ended at a leaf at depth d - 1, so no token
    was tried at d.
    """

    accepted: list[int]
    rejected: list[int]
    leaf: list[int]

    @property
    def tried(self) -> list[int]:
        """Steps that tried a draft token at each depth (accepted + rejected)."""
        return [a + r for a, r in zip(self.accepted, self.rejected)]

    def rates(self) -> list[float]:
        """Per-depth acceptance: accepted / tried at each depth (NaN where nothing was tried)."""
        return [a / t if t else _NAN for a, t in zip(self.accepted, self.tried)]


def depth_counts(outcomes: Iterable[Sequence[bool]], max_depth: int) -> DepthCounts:
    """:class:`DepthCounts` over depths 1 .. ``max_depth`` of per-step outcomes (:meth:`StepRecord.outcome`:
    True per accepted depth, then False when the next depth's token was rejected)."""
    counts = DepthCounts([0] * max_depth, [0] * max_depth, [0] * max_depth)
    for outcome in outcomes:
        accepted = sum(1 for x in outcome if x)
        for d in range(min(accepted, max_depth)):
            counts.accepted[d] += 1
        if accepted < max_depth:
            (counts.rejected if len(outcome) > accepted else counts.leaf)[accepted] += 1
    return counts


def _mean(values: list[torch.Tensor | None]) -> float:
    """The mean of every non-NaN element of the tensors given (None: none); NaN when there are none."""
    present = [v.reshape(-1) for v in values if v is not None]
    flat = torch.cat(present) if present else torch.empty(0)
    flat = flat[~flat.isnan()]
    return float(flat.mean()) if flat.numel() else _NAN


@dataclass
class SpecMetrics:
    """Summary of many generations (one list of steps per question); ``per_depth_acceptance`` is
    ``depth.rates()``."""

    questions: int
    steps: int
    tokens: int
    tau: float
    tau_per_question: float
    per_depth_acceptance: list[float]
    depth: DepthCounts
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
    depth = depth_counts((r.outcome() for r in records), max((int(r.tree_depth) for r in records), default=0))
    return SpecMetrics(
        questions=len(per_question),
        steps=len(records),
        tokens=sum(r.appended for r in records),
        tau=tau(records),
        tau_per_question=mean_tau(tau(steps) for steps in per_question),
        per_depth_acceptance=depth.rates(),
        depth=depth,
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
