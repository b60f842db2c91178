"""Exactness accounting: how a decoding's output differs from same-dtype vanilla, and whether each
difference is a tie within rounding.

In float32 on dense weights, speculative greedy output equals vanilla token for token. In reduced
precision (bfloat16 activations, low-bit weights) the tree forward (n queries) and the vanilla forward
(one query) can round differently, so the two can part where the target's top two tokens are nearly
tied. For every output that differs from
vanilla, :func:`account` finds the first differing position and measures, with a float32 copy of
the target, the logit gap between the two tokens there (``gap``). It also measures the rounding
error of the dtype itself: the largest |low-precision - float32| logit difference over the same
prompts and vanilla outputs, teacher forced (``max_logit_error``). A divergence whose gap is below
that error is a tie within rounding; any other divergence is a bug.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from taps_ray.eval.records import record_method
from taps_ray.models.target import TargetModel


@dataclass
class Divergence:
    """The first position where ``method``'s output differs from vanilla on prompt ``prompt``."""

    method: str
    prompt: int
    position: int
    vanilla_token: int
    other_token: int
    gap: float  # float32 logit of vanilla_token minus that of other_token at this position
    tie: bool  # |gap| <= the dtype's max logit error on these prompts


@dataclass
class ExactnessReport:
    """Per method: outputs identical to same-dtype vanilla, and every divergence explained."""

    dtype: str
    prompts: int
    identical: dict[str, int] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)
    max_logit_error: float = 0.0  # max |dtype - fp32| logit over the prompts' vanilla outputs (0 in fp32)

    @property
    def all_ties(self) -> bool:
        """True when every divergence is a tie within rounding (always False for a float32 divergence)."""
        return all(d.tie for d in self.divergences)

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "prompts": self.prompts, "identical": self.identical,
                "max_logit_error": self.max_logit_error, "all_ties": self.all_ties,
                "divergences": [asdict(d) for d in self.divergences]}

    def to_markdown(self) -> str:
        lines = [f"Exactness vs vanilla in the same precision ({self.dtype}) over {self.prompts} prompts; largest "
                 f"|{self.dtype} - dense float32| logit error on these prompts: {self.max_logit_error:.4f}.", "",
                 "| method | identical to vanilla | divergences | all ties within rounding |", "|---|---:|---:|---|"]
        for method, same in self.identical.items():
            mine = [d for d in self.divergences if d.method == method]
            verdict = "yes" if all(d.tie for d in mine) else "**no**"
            lines.append(f"| {method} | {same}/{self.prompts} | {len(mine)} | {verdict} |")
        if self.divergences:
            lines += ["", "| method | prompt | position | vanilla token | other token | fp32 logit gap | tie |",
                      "|---|---:|---:|---:|---:|---:|---|"]
            lines += [f"| {d.method} | {d.prompt} | {d.position} | {d.vanilla_token} | {d.other_token} | "
                      f"{d.gap:.4f} | {'yes' if d.tie else '**no**'} |" for d in self.divergences]
        return "\n".join(lines)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def _logits(target: TargetModel, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [T, V] of ``ids`` [T], teacher forced."""
    return target.prefill(ids[None].to(target.device)).logits[0].float().cpu()


def account(target: TargetModel, reference: TargetModel | None, prompts: list[torch.Tensor],
            outputs: dict[str, list[list[int]]], baseline: str = "vanilla") -> ExactnessReport:
    """Compare every method in ``outputs`` (token ids per prompt) with ``outputs[baseline]``.

    ``reference`` is a dense float32 copy of ``target`` (None when ``target`` is that itself, where any
    divergence is reported as not a tie). ``prompts`` [T] are the prompt ids in the same order.
    """
    vanilla = outputs[baseline]
    report = ExactnessReport(dtype=target.precision, prompts=len(prompts))
    low_precision = reference is not None and not target.exact_reference
    references: dict[int, torch.Tensor] = {}

    def generated_logits(model: TargetModel, i: int) -> torch.Tensor:
        """Logits [len(vanilla[i]) + 1, V] predicting each generated token (and the next)."""
        ids = torch.cat([prompts[i].cpu(), torch.tensor(vanilla[i], dtype=torch.long)])
        return _logits(model, ids)[prompts[i].numel() - 1:]

    if low_precision:
        for i in range(len(prompts)):
            references[i] = generated_logits(reference, i)
            error = (generated_logits(target, i) - references[i]).abs().max().item()
            report.max_logit_error = max(report.max_logit_error, error)
    for method, method_outputs in outputs.items():
        if method == baseline:
            continue
        report.identical[method] = 0
        for i, (mine, theirs) in enumerate(zip(method_outputs, vanilla)):
            position = first_difference(theirs, mine)
            if position is None:
                report.identical[method] += 1
                continue
            if position >= min(len(theirs), len(mine)):
                gap, tie = float("nan"), False  # one stopped early: not a token choice, never a tie
                v_token = theirs[position] if position < len(theirs) else -1
                o_token = mine[position] if position < len(mine) else -1
            else:
                v_token, o_token = theirs[position], mine[position]
                if low_precision:
                    row = references[i][position]
                    gap = float(row[v_token] - row[o_token])
                    tie = abs(gap) <= report.max_logit_error
                else:
                    gap, tie = float("nan"), False
            report.divergences.append(Divergence(method, i, position, v_token, o_token, gap, tie))
    return report


EXACTNESS_FILE = "exactness.json"


def account_records(target: TargetModel, reference: TargetModel | None, records: list[dict]) -> ExactnessReport:
    """:func:`account` over an evaluation's greedy records (``prompt_ids``/``output_ids`` per turn).

    Every (question, turn) decoded by ``vanilla`` at T = 0 is one prompt; a strategy is compared on each
    turn up to and including its first differing turn (later turns had another conversation); a
    production-method record counts as its own method, ``STRATEGY (production)``.
    """
    greedy = [r for r in records if float(r["temperature"]) == 0 and "output_ids" in r]
    vanilla = {(r["benchmark"], str(r["question_id"])): r for r in greedy if r["strategy"] == "vanilla"}
    keys = [(key, turn) for key, r in vanilla.items() for turn in range(len(r["output_ids"]))]
    prompts = [torch.tensor(vanilla[key]["prompt_ids"][turn], dtype=torch.long) for key, turn in keys]
    outputs: dict[str, list[list[int]]] = {"vanilla": [vanilla[key]["output_ids"][turn] for key, turn in keys]}
    def label(r: dict) -> str:
        return r["strategy"] if record_method(r) == "paper" else f"{r['strategy']} ({record_method(r)})"

    others = sorted({label(r) for r in greedy} - {"vanilla"})
    by_key = {(r["benchmark"], str(r["question_id"]), label(r)): r for r in greedy}
    for strategy in others:
        outputs[strategy] = []
        for (key, turn), reference_output in zip(keys, outputs["vanilla"]):
            record = by_key.get((*key, strategy))
            earlier_differ = record is not None and any(
                record["output_ids"][t] != vanilla[key]["output_ids"][t] for t in range(turn))
            if record is None or earlier_differ:
                outputs[strategy].append(reference_output)  # counted at its first differing turn, or not run
            else:
                outputs[strategy].append(record["output_ids"][turn])
    return account(target, reference, prompts, outputs)
