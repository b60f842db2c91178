"""generate(logprobs=k): the emitted tokens' raw target log-probabilities, from the verification's logits,
equal the target's log-softmax along the sequence (teacher-forced and vanilla) within 1e-4 in fp32."""

from __future__ import annotations

import pytest
import torch

from taps_ray.config import SamplingConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec.decoder import generate
from taps_ray.spec.logprobs import TokenLogprobs, token_logprobs
from taps_ray.spec.protocol import SingleStrategy
from tests.spec.spec_helpers import OracleStrategy, random_prompt

TREE = TreeConfig(depth=3, top_k=4, total_tokens=16, lookup_tokens=0)
ATOL = 1e-4


def teacher_forced(target, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """log_softmax [n, V] of the target's logits at the positions that predict ``tokens`` after ``prompt``."""
    sequence = torch.cat([prompt, torch.tensor(tokens, dtype=torch.long)])
    with torch.inference_mode():
        logits = target.logits(target.hidden_states(sequence[None, :-1]))[0, prompt.numel() - 1:]
    return torch.log_softmax(logits.float(), -1)


def assert_matches(logprobs: TokenLogprobs, expected: torch.Tensor, tokens: list[int], top: int) -> None:
    ids = torch.tensor(tokens)
    assert len(logprobs) == len(tokens) and logprobs.top_ids.shape == (len(tokens), top)
    torch.testing.assert_close(logprobs.logprobs, expected.gather(1, ids[:, None]).squeeze(1), atol=ATOL, rtol=0)
    values, order = expected.topk(top, -1)
    torch.testing.assert_close(logprobs.top_logprobs, values, atol=ATOL, rtol=0)
    assert torch.equal(logprobs.top_ids, order)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_speculative_logprobs_equal_vanilla_and_the_target_log_softmax(peaky_target, seed):
    prompt = random_prompt(peaky_target, 6 + 2 * seed, 900 + seed)
    vanilla = generate(peaky_target, prompt, max_new_tokens=40, logprobs=5)
    expected = teacher_forced(peaky_target, prompt, vanilla.token_ids)
    assert_matches(vanilla.logprobs, expected, vanilla.token_ids, 5)
    sequence = torch.cat([prompt, torch.tensor(vanilla.token_ids)])
    for strategy in (SingleStrategy(DraftHead(peaky_target.config, seed=seed), TREE),
                     OracleStrategy(sequence, peaky_target.vocab_size, depth=5, seed=seed)):
        spec = generate(peaky_target, prompt, strategy, max_new_tokens=40, logprobs=5)
        assert spec.token_ids == vanilla.token_ids
        torch.testing.assert_close(spec.logprobs.logprobs, vanilla.logprobs.logprobs, atol=ATOL, rtol=0)
        assert_matches(spec.logprobs, expected, spec.token_ids, 5)
    assert max(spec.accept_lengths) == 5, "the oracle's long accepted paths were exercised"


def test_sampled_tokens_get_the_raw_target_log_softmax(peaky_target):
    """Sampling at T = 0.7, top-p 0.9: the reported logprobs are the raw distribution's (before temperature
    and top-p), independent of the sampling parameters."""
    prompt = random_prompt(peaky_target, 7, 910)
    spec = generate(peaky_target, prompt, SingleStrategy(DraftHead(peaky_target.config, seed=4), TREE),
                    SamplingConfig(temperature=0.7, top_p=0.9, seed=3), max_new_tokens=30, logprobs=2)
    assert_matches(spec.logprobs, teacher_forced(peaky_target, prompt, spec.token_ids), spec.token_ids, 2)


@pytest.mark.parametrize("max_new_tokens, eos_at", [(1, None), (13, None), (40, 9)])
def test_streamed_parts_cover_exactly_the_kept_tokens(peaky_target, max_new_tokens, eos_at):
    """``on_logprobs`` gets one part per commit (trimmed at EOS and the budget) joining to ``result.logprobs``."""
    prompt = random_prompt(peaky_target, 8, 920)
    vanilla = generate(peaky_target, prompt, max_new_tokens=40)
    sequence = torch.cat([prompt, torch.tensor(vanilla.token_ids)])
    eos = {vanilla.token_ids[eos_at]} if eos_at is not None else None
    parts: list[TokenLogprobs] = []
    spec = generate(peaky_target, prompt, OracleStrategy(sequence, peaky_target.vocab_size, depth=5, corrupt=False),
                    max_new_tokens=max_new_tokens, eos_token_ids=eos, logprobs=0, on_logprobs=parts.append)
    assert len(parts) == len(spec.steps) + 1 and sum(map(len, parts)) == len(spec.token_ids)
    assert torch.equal(TokenLogprobs.cat(parts, 0).logprobs, spec.logprobs.logprobs)
    assert spec.logprobs.top_ids.shape == (len(spec.token_ids), 0)
    assert_matches(spec.logprobs, teacher_forced(peaky_target, prompt, spec.token_ids), spec.token_ids, 0)


def test_off_by_default_and_bad_values_name_the_value(peaky_target):
    prompt = random_prompt(peaky_target, 5, 930)
    assert generate(peaky_target, prompt, max_new_tokens=3).logprobs is None
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match=rf"logprobs must be None \(off\) or an integer in \[0, 20\].*got {bad!r}"):
            generate(peaky_target, prompt, max_new_tokens=3, logprobs=bad)


def test_token_logprobs_slices_and_joins():
    logits = torch.randn(4, 10)
    part = token_logprobs(logits, torch.tensor([1, 2, 3, 4]), 3)
    torch.testing.assert_close(part.logprobs, torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor([1, 2, 3, 4])])
    assert len(part[1:3]) == 2 and len(TokenLogprobs.cat([part[:1], part[1:]], 3)) == 4
    assert len(TokenLogprobs.cat([], 3)) == 0
    with pytest.raises(TypeError, match="takes a slice, got int"):
        part[0]
