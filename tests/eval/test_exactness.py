import copy

import pytest
import torch

from taps_ray.eval.exactness import account, first_difference
from taps_ray.models.target import TargetModel
from taps_ray.spec.decoder import generate, load_drafter
from taps_ray.spec.protocol import SingleStrategy
from tests.conftest import make_tiny_target


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def _bf16_copy(target: TargetModel) -> TargetModel:
    return TargetModel(copy.deepcopy(target.model).to(torch.bfloat16), None, target.name)


def test_divergence_gap_is_the_fp32_logit_difference_and_ties_are_judged_by_the_dtype_error():
    fp32 = make_tiny_target(0)
    bf16 = _bf16_copy(fp32)
    prompt = torch.arange(2, 12)
    vanilla = generate(bf16, prompt, max_new_tokens=6).token_ids
    other = list(vanilla)
    other[3] = (other[3] + 1) % 256
    report = account(bf16, fp32, [prompt], {"vanilla": [vanilla], "spec": [vanilla], "odd": [other]})
    assert report.identical == {"spec": 1, "odd": 0}
    assert report.max_logit_error > 0
    (divergence,) = report.divergences
    assert (divergence.method, divergence.prompt, divergence.position) == ("odd", 0, 3)
    logits = fp32.prefill(torch.cat([prompt, torch.tensor(vanilla[:3])])[None]).logits[0, -1]
    assert divergence.gap == pytest.approx(float(logits[vanilla[3]] - logits[other[3]]), abs=1e-5)
    assert divergence.tie == (abs(divergence.gap) <= report.max_logit_error)
    assert "odd" in report.to_markdown() and report.to_dict()["divergences"][0]["position"] == 3


def test_float32_divergence_is_never_a_tie():
    fp32 = make_tiny_target(0)
    prompt = torch.arange(2, 12)
    vanilla = generate(fp32, prompt, max_new_tokens=4).token_ids
    other = [(vanilla[0] + 1) % 256, *vanilla[1:]]
    report = account(fp32, None, [prompt], {"vanilla": [vanilla], "spec": [other]})
    assert report.max_logit_error == 0 and not report.all_ties and report.divergences[0].position == 0


@pytest.mark.integration
def test_bf16_speculative_divergences_on_the_embedded_target_are_ties(embedded_target):
    """bf16 tree verification vs bf16 vanilla: every difference is a near-tie measured in fp32."""
    bf16 = TargetModel.load(embedded_target_config())
    drafter = load_drafter(bf16)
    prompts = [bf16.encode_chat([{"role": "user", "content": q}])[0]
               for q in ("What is 12 * 7? Explain briefly.", "Name three colours of the rainbow.")]
    outputs = {"vanilla": [generate(bf16, p, max_new_tokens=20).token_ids for p in prompts],
               "spec": [generate(bf16, p, SingleStrategy(drafter), max_new_tokens=20).token_ids for p in prompts]}
    report = account(bf16, embedded_target, prompts, outputs)
    assert report.dtype.startswith("bfloat16") and 0 < report.max_logit_error < 5  # ", int4 weights" where auto picks them
    assert report.identical["spec"] + len(report.divergences) == len(prompts)
    assert report.all_ties, report.to_markdown()


def embedded_target_config():
    from taps_ray.config import TargetConfig

    return TargetConfig(dtype="bfloat16")


def test_eval_records_are_compared_turn_by_turn_up_to_the_first_difference():
    from taps_ray.eval.exactness import account_records

    target = make_tiny_target(0)

    def record(strategy, outputs):
        return {"benchmark": "mt_bench", "question_id": 81, "strategy": strategy, "temperature": 0.0,
                "prompt_ids": [[2, 3, 4], [2, 3, 4, 9, 2, 5]], "output_ids": outputs}

    records = [record("vanilla", [[9, 9], [7, 7]]), record("single:math", [[9, 9], [7, 7]]),
               record("merged:budget", [[9, 8], [6, 6]]), record("merged:union", [[9, 9], [7, 5]])]
    report = account_records(target, None, records)
    assert report.prompts == 2
    assert report.identical == {"merged:budget": 1, "merged:union": 1, "single:math": 2}
    assert [(d.method, d.prompt, d.position) for d in report.divergences] == [("merged:budget", 0, 1),
                                                                               ("merged:union", 1, 1)]
