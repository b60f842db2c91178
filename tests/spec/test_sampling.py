"""Speculative sampling is lossless: the first three generated tokens follow the target's exact law.

Tiny random Llama (vocab 16) and a fixed prefix; the exact joint law of (t1, t2, t3) is computed in
three batched target passes (all 16 and 256 continuations at once) with the same logits processors.
Each setting draws n sequences through ``generate`` (one seed each) and applies a chi-square
goodness-of-fit test to the 4096 cells, cells with expected count < 5 pooled.

Threshold: the seeds are fixed, so each test is deterministic; under a correct sampler the
statistic is chi2(df)-distributed and p < 1e-3 would happen for 1 seed in 1000. Power at this n:
the same samples are tested against a nearby wrong law (another temperature, or no top-p) and
must be rejected at p < 1e-3; a sampler that, e.g., accepted drafts greedily or ignored top-p
would be off by at least that much. Tokens outside the top-p nucleus must never appear.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch

from taps_ray.config import SamplingConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import DecodeState, SingleStrategy
from taps_ray.spec.tree import DraftTree, build_tree
from tests.spec.spec_helpers import (
    chi_square_p_value,
    joint_law,
    next_token_laws,
    peaky_tiny_target,
    random_prompt,
)

V = 16
TARGET = peaky_tiny_target(5, vocab_size=V, hidden_size=32, scale=1.2)
PREFIX = random_prompt(TARGET, 6, seed=11)
P_VALUE = 1e-3


def exact_tables(temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Processed next-token laws: p1 [V] after the prefix, p2 [V, V] after (t1), p3 [V, V, V] after (t1, t2)."""
    p1, p2, p3 = next_token_laws(TARGET, PREFIX, 3, temperature, top_p)
    return p1, p2, p3


def exact_joint(temperature: float, top_p: float) -> torch.Tensor:
    return joint_law(list(exact_tables(temperature, top_p)))


class ExactOracle:
    """Proposes trees of the target's most likely continuations (so drafts are often accepted, at
    depth 1 and 2, and rejections fall through to the residual): root t1 -> top-3 of p2 -> top-2 of p3."""

    name = "exact-oracle"

    def __init__(self, p2: torch.Tensor, p3: torch.Tensor):
        self.p2, self.p3 = p2, p3

    def start(self, target, tokens, features):
        pass

    def advance(self, tokens, features):
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        generated = state.tokens[state.prompt_len:].tolist()
        tokens, parents, scores = [generated[-1]], [-1], [0.0]
        first = self.p2[generated[0]] if len(generated) == 1 else self.p3[generated[0], generated[1]]
        for prob, token in zip(*first.topk(3)):
            tokens.append(int(token))
            parents.append(0)
            scores.append(math.log(float(prob) + 1e-12))
            node = len(tokens) - 1
            if len(generated) == 1:
                for prob2, token2 in zip(*self.p3[generated[0], int(token)].topk(2)):
                    tokens.append(int(token2))
                    parents.append(node)
                    scores.append(scores[node] + math.log(float(prob2) + 1e-12))
        return build_tree(tokens, parents, scores, prefix_len=state.prefix_len)


def sample_counts(make_strategy, sampling: dict, n: int) -> tuple[torch.Tensor, list[int]]:
    counts = collections.Counter()
    accepted = []
    for seed in range(n):
        result = generate(TARGET, PREFIX, make_strategy(), SamplingConfig(seed=seed, **sampling), max_new_tokens=3,
                          eos_token_ids=frozenset(), collect_entropy=False)
        t1, t2, t3 = result.token_ids
        counts[(t1 * V + t2) * V + t3] += 1
        accepted += result.accept_lengths
    dense = torch.zeros(V ** 3, dtype=torch.float64)
    for cell, count in counts.items():
        dense[cell] = count
    return dense, accepted


def fresh_drafter_strategy():
    return SingleStrategy(DraftHead(TARGET.config, seed=4), TreeConfig(depth=2, top_k=3, total_tokens=8, lookup_tokens=0))


LOOKUP_TREE = TreeConfig(depth=1, top_k=2, total_tokens=4, lookup_tokens=3, lookup_ngram=2, lookup_min_ngram=1)


def lookup_drafter_strategy():
    """A fresh drafter's tree with prompt-lookup chains grafted on (the 16-token vocabulary makes
    context matches, and so chains of copied tokens, frequent)."""
    return SingleStrategy(DraftHead(TARGET.config, seed=4), LOOKUP_TREE)


def test_lookup_chains_are_grafted_on_this_prefix():
    result = generate(TARGET, PREFIX, lookup_drafter_strategy(), SamplingConfig(seed=0, temperature=0.7, top_p=0.9),
                      max_new_tokens=3, eos_token_ids=frozenset(), collect_entropy=False)
    assert any(step.tree_size > LOOKUP_TREE.total_tokens for step in result.steps)


@pytest.mark.slow
@pytest.mark.parametrize("sampling, wrong, strategy, n", [
    ({"temperature": 1.0}, {"temperature": 0.8, "top_p": 1.0}, "oracle", 3000),
    ({"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7, "top_p": 1.0}, "oracle", 3000),
    ({"temperature": 1.0}, {"temperature": 0.8, "top_p": 1.0}, "drafter", 1200),
    ({"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7, "top_p": 1.0}, "drafter+lookup", 1200),
])
def test_first_tokens_follow_the_target_law(sampling, wrong, strategy, n):
    temperature, top_p = sampling["temperature"], sampling.get("top_p", 1.0)
    p1, p2, p3 = exact_tables(temperature, top_p)
    joint = joint_law([p1, p2, p3])
    make = {"oracle": lambda: ExactOracle(p2, p3), "drafter": fresh_drafter_strategy,
            "drafter+lookup": lookup_drafter_strategy}[strategy]
    counts, accepted = sample_counts(make, sampling, n)
    assert counts[joint == 0].sum() == 0, "a token outside the top-p nucleus was generated"
    p_value = chi_square_p_value(counts, joint)
    assert p_value > P_VALUE, f"speculative samples do not follow the target law (p = {p_value:.2e})"
    control = chi_square_p_value(counts, exact_joint(wrong["temperature"], wrong["top_p"]))
    assert control < P_VALUE, f"the test cannot tell a nearby wrong law apart (p = {control:.2e})"
    if strategy == "oracle":
        assert 2 in accepted and 0 in accepted and sum(accepted) / len(accepted) > 0.5
