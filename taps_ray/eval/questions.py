"""The questions of an evaluation run: each benchmark's seeded ``limit`` subset, drawn after every
question a drafter under evaluation trained on is excluded (its ``trained_prompts.json``,
:mod:`taps_ray.data.contamination`); a benchmark that cannot be loaded here is skipped. Both are
reported per benchmark, as data (recorded in ``run.json``) and as printed lines.
"""

from __future__ import annotations

from dataclasses import dataclass

from taps_ray.data.benchmarks import BenchmarkQuestion, select_benchmark
from taps_ray.data.contamination import question_hashes
from taps_ray.data.origins import SourceUnavailable
from taps_ray.eval.plan import EvalError, EvalPlan, trained_prompts_of


@dataclass
class QuestionSelection:
    """The questions of a run per benchmark, what was excluded or skipped (``info``, recorded in
    ``run.json``) and the printed lines (``notes``)."""

    questions: dict[str, list[BenchmarkQuestion]]
    info: dict[str, dict]
    notes: list[str]


def _seen_by(question: BenchmarkQuestion, seen: dict[str, set[str]]) -> list[str]:
    hashes = question_hashes(question.turns)
    return [name for name, trained in seen.items() if hashes & trained]


def select_questions(plan: EvalPlan, given: dict[str, list[BenchmarkQuestion]] | None = None) -> QuestionSelection:
    """Each benchmark's questions less those any drafter of ``plan`` trained on, then ``plan.limit`` of
    them (seeded; of ``given`` questions: the first ``limit``); unavailable benchmarks are skipped.
    EvalError when no benchmark is left."""
    seen = trained_prompts_of(plan.drafters)
    union = set().union(*seen.values())
    questions, info, notes = {}, {}, []
    for name in plan.benchmarks:
        if given is not None:
            if name not in given:
                continue
            excluded = [q for q in given[name] if question_hashes(q.turns) & union]
            kept = [q for q in given[name] if not question_hashes(q.turns) & union]
            chosen, origin, total = kept[:plan.limit], "given", len(given[name])
        else:
            try:
                selection = select_benchmark(name, limit=plan.limit, seed=plan.seed, exclude=union)
            except SourceUnavailable as err:
                reason = "; ".join(line.strip() for line in str(err).splitlines()[1:]) or str(err)
                info[name] = {"skipped": reason}
                notes.append(f"{name}: skipped, not available here ({reason})")
                continue
            chosen, origin, total = selection.questions, selection.origin, selection.total
            excluded = selection.excluded_questions
        by = sorted({d for q in excluded for d in _seen_by(q, seen)})
        questions[name] = chosen
        info[name] = {"origin": origin, "total": total, "excluded": len(excluded), "excluded_by": by,
                      "selected": len(chosen)}
        detail = (f"{len(excluded)} of {total} excluded as seen in training by {', '.join(by)}" if excluded
                  else "none excluded" + ("" if union else " (no drafter records training prompts)"))
        notes.append(f"{name}: {len(chosen)} of {total - len(excluded)} questions drawn; {detail}")
    if not questions:
        raise EvalError(f"no benchmark of {plan.benchmarks} can be evaluated here: " + "; ".join(notes))
    return QuestionSelection(questions, info, notes)


def load_questions(plan: EvalPlan) -> dict[str, list[BenchmarkQuestion]]:
    """:func:`select_questions` without the bookkeeping."""
    return select_questions(plan).questions
