"""generate() on a tiny target: greedy exactness, stopping and trimming, drafter alignment, bad input, stats."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from taps_ray.config import SamplingConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import SingleStrategy, Strategy, VanillaStrategy
from taps_ray.spec.stats import (
    StepRecord,
    acceptance_length,
    depth_counts,
    mean_tau,
    stop_trimmed,
    summarize,
    tau,
)
from taps_ray.spec.tree import DraftTree
from tests.spec.spec_helpers import OracleStrategy, random_prompt

TREES = [TreeConfig(depth=3, top_k=4, total_tokens=16, lookup_tokens=0), TreeConfig(depth=0, top_k=1, total_tokens=2, lookup_tokens=0),
         TreeConfig(depth=2, top_k=6, total_tokens=40, lookup_tokens=0)]


def reference(target, prompt, max_new_tokens=40, **kwargs):
    """Vanilla greedy output and prompt + output as one sequence."""
    result = generate(target, prompt, max_new_tokens=max_new_tokens, **kwargs)
    return result, torch.cat([prompt, torch.tensor(result.token_ids, dtype=torch.long)])


@pytest.mark.parametrize("seed", range(6))
def test_fresh_drafter_greedy_equals_vanilla(peaky_target, seed):
    prompt = random_prompt(peaky_target, 5 + 3 * seed, seed)
    vanilla, _ = reference(peaky_target, prompt)
    assert vanilla.strategy == "vanilla" and len(vanilla.steps) == len(vanilla.token_ids) - 1 and vanilla.tau == 1
    drafter = DraftHead(peaky_target.config, seed=seed)
    spec = generate(peaky_target, prompt, SingleStrategy(drafter, TREES[seed % 3]), max_new_tokens=40)
    assert spec.token_ids == vanilla.token_ids
    assert spec.finish_reason == vanilla.finish_reason and spec.strategy == "single"
    assert {s.tree_size for s in spec.steps} == {TREES[seed % 3].total_tokens}


@pytest.mark.parametrize("seed", range(8))
def test_oracle_trees_greedy_equals_vanilla(peaky_target, seed):
    """Long accepted paths interleaved with decoys: compaction, bonus tokens and advance() all line up."""
    prompt = random_prompt(peaky_target, 4 + seed, 100 + seed)
    vanilla, sequence = reference(peaky_target, prompt, max_new_tokens=60)
    oracle = OracleStrategy(sequence, peaky_target.vocab_size, depth=5, seed=seed)
    spec = generate(peaky_target, prompt, oracle, max_new_tokens=60)
    assert spec.token_ids == vanilla.token_ids
    assert max(spec.accept_lengths) == 5 and min(spec.accept_lengths) < 5
    assert sum(s.appended for s in spec.steps) + 1 == len(spec.token_ids)
    assert spec.tau == pytest.approx((len(spec.token_ids) - 1) / len(spec.steps))


def test_drafter_pairs_align_with_target_features(peaky_target):
    """The strategy sees pairs (token_{i+1}, f_i): tokens shifted by one and the target's teacher-forced
    features at positions 0..n-1 (accepted nodes' features come from the tree forward)."""
    prompt = random_prompt(peaky_target, 9, 7)
    _, sequence = reference(peaky_target, prompt, max_new_tokens=50)
    oracle = OracleStrategy(sequence, peaky_target.vocab_size, depth=4, seed=3)
    generate(peaky_target, prompt, oracle, max_new_tokens=50)
    tokens, features = oracle.pair_arrays()
    n = tokens.numel()
    assert n > 40
    assert torch.equal(tokens, sequence[1:n + 1])
    teacher = peaky_target.hidden_states(sequence[None, :n])[0]
    torch.testing.assert_close(features, teacher, atol=1e-4, rtol=1e-4)


def first_new_occurrence(tokens: list[int], candidates) -> int:
    return next(i for i in candidates if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("seed", range(3))
def test_eos_inside_accepted_path_is_trimmed(peaky_target, seed):
    prompt = random_prompt(peaky_target, 8, 200 + seed)
    vanilla, sequence = reference(peaky_target, prompt, max_new_tokens=40)
    out = vanilla.token_ids
    # steps of a full oracle chain append 6 tokens after the prefill token: index 1 + 6j + 5 closes a step
    stop = first_new_occurrence(out, [i for i in range(3, 30) if (i - 1) % 6 != 5])
    eos = {out[stop]}
    plain = generate(peaky_target, prompt, max_new_tokens=40, eos_token_ids=eos)
    assert plain.token_ids == out[:stop + 1] and plain.finish_reason == "eos"
    oracle = OracleStrategy(sequence, peaky_target.vocab_size, depth=5, seed=seed, corrupt=False)
    spec = generate(peaky_target, prompt, oracle, max_new_tokens=40, eos_token_ids=eos)
    assert spec.token_ids == out[:stop + 1] and spec.finish_reason == "eos"
    last = spec.steps[-1]
    assert last.accepted == 5 and last.appended < last.accepted + 1, "tokens after EOS were trimmed"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 10, 16])
def test_max_new_tokens_reached_mid_path(peaky_target, max_new_tokens):
    prompt = random_prompt(peaky_target, 8, 300)
    vanilla, sequence = reference(peaky_target, prompt, max_new_tokens=30)
    oracle = OracleStrategy(sequence, peaky_target.vocab_size, depth=5, seed=0, corrupt=False)
    spec = generate(peaky_target, prompt, oracle, max_new_tokens=max_new_tokens)
    assert spec.token_ids == vanilla.token_ids[:max_new_tokens] and spec.finish_reason == "length"
    if max_new_tokens > 7:
        assert spec.steps[-1].appended < spec.steps[-1].accepted + 1


def test_context_limit_stops_both_paths_alike(peaky_target):
    target = copy.copy(peaky_target)
    prompt = random_prompt(target, 10, 400)
    target.max_context = 30
    vanilla = generate(target, prompt, max_new_tokens=100)
    spec = generate(target, prompt, SingleStrategy(DraftHead(target.config, seed=1), TREES[0]), max_new_tokens=100)
    assert vanilla.finish_reason == spec.finish_reason == "context"
    assert spec.token_ids == vanilla.token_ids and len(vanilla.token_ids) == 21


def test_sampling_is_reproducible_with_a_seed(peaky_target):
    prompt = random_prompt(peaky_target, 6, 500)
    strategy = lambda: SingleStrategy(DraftHead(peaky_target.config, seed=2), TREES[0])  # noqa: E731
    runs = [generate(peaky_target, prompt, strategy(), SamplingConfig(temperature=0.8, top_p=0.9, seed=s),
                     max_new_tokens=20).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("prompt, kwargs, message", [
    ("", {}, "prompt is empty"),
    ([], {}, "prompt is empty"),
    (list(range(2, 602)), {}, "prompt has 600 tokens; the target's max_context 512"),
    ([5, 6], {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ([5, 6], {"sampling": {"temperature": -0.5}}, "temperature must be >= 0 .*got -0.5"),
    ([5, 6], {"sampling": {"temperature": 1.0, "top_p": 0.0}}, r"top_p must be in \(0, 1\], got 0.0"),
    ([5, 6], {"sampling": {"temperature": 1.0, "top_p": 1.5}}, r"top_p must be in \(0, 1\], got 1.5"),
    ([5, 6], {"sampling": {"top_k": -2}}, "top_k must be an integer >= 0 .*got -2"),
])
def test_bad_input_is_a_value_error_naming_the_value(peaky_target, prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(peaky_target, prompt, **kwargs)


def test_build_strategy_and_protocol(peaky_target):
    drafter = DraftHead(peaky_target.config)
    assert isinstance(build_strategy("vanilla"), VanillaStrategy)
    assert isinstance(build_strategy("single", [drafter]), Strategy)
    with pytest.raises(ValueError, match="needs a drafter"):
        build_strategy("single", [])
    with pytest.raises(ValueError, match="unknown strategy 'routed'"):
        build_strategy("routed", [drafter])


def test_step_records_and_summary(peaky_target):
    prompt = random_prompt(peaky_target, 8, 600)
    _, sequence = reference(peaky_target, prompt, max_new_tokens=40)
    spec = generate(peaky_target, prompt, OracleStrategy(sequence, peaky_target.vocab_size, depth=4, seed=1),
                    max_new_tokens=40)
    metrics = summarize([spec.steps])
    assert metrics.steps == len(spec.steps) and metrics.tokens == len(spec.token_ids) - 1
    assert metrics.tau == pytest.approx(spec.tau) and metrics.tau > 2
    assert len(metrics.per_depth_acceptance) == 5 and sum(metrics.accept_length_counts) == metrics.steps
    for step in spec.steps:
        assert step.draft_entropy.numel() == step.target_entropy.numel() == step.accepted
        assert step.rejected == (step.accepted < 4)
    assert metrics.entropy["accepted_target"] >= 0 and metrics.entropy["rejected_target"] >= 0
    payload = json.loads(json.dumps(spec.to_dict(with_steps=True)))
    assert payload["steps"] == len(spec.steps) and payload["token_ids"] == spec.token_ids


def test_tau_and_per_depth_definitions():
    steps = [StepRecord(accepted=a, appended=n, tree_size=8, draft_s=0.0, verify_s=0.0, tree_depth=3, rejected=rej)
             for a, n, rej in [(0, 1, True), (2, 3, True), (3, 4, False), (1, 2, False), (3, 2, False)]]
    assert tau(steps) == pytest.approx(12 / 5)
    assert [s.outcome() for s in steps[:2]] == [[False], [True, True, False]]
    counts = depth_counts((s.outcome() for s in steps), max_depth=3)
    assert (counts.accepted, counts.rejected, counts.leaf) == ([4, 3, 2], [1, 0, 1], [0, 1, 0])
    assert counts.rates() == pytest.approx([4 / 5, 3 / 3, 2 / 3])
    assert depth_counts([], 0).rates() == []
    metrics = summarize([steps[:2], steps[2:]])
    assert metrics.tau == pytest.approx(12 / 5)
    assert metrics.tau_per_question == pytest.approx((4 / 2 + 8 / 3) / 2)
    assert metrics.accept_length_counts == [1, 1, 1, 2]
    assert metrics.per_depth_acceptance == pytest.approx([4 / 5, 1.0, 2 / 3]) and metrics.depth.leaf == [0, 1, 0]


def test_mean_tau_and_stop_trimming():
    assert mean_tau([2.0, None, math.nan, 4.0]) == 3.0 and math.isnan(mean_tau([None]))
    assert math.isnan(acceptance_length(0, 0)) and acceptance_length(7, 2) == 3.5
    assert stop_trimmed([3, 4, 2], 5) == [3, 2, 0] and stop_trimmed([1, 2], 10) == [1, 2]
    with pytest.raises(ValueError, match="kept must be >= 0, got -1"):
        stop_trimmed([1], -1)


class RepeatingStrategy(SingleStrategy):
    """A custom strategy whose trees repeat a token among the children of node ``at`` (built as a raw
    :class:`DraftTree`, past the checks of ``build_tree``)."""

    name = "repeating"

    def __init__(self, drafter, at: int):
        super().__init__(drafter, TREES[0])
        self.at = at

    def propose(self, state):
        tree = super().propose(state)
        children = (tree.parent == self.at).nonzero().squeeze(1)
        tokens = tree.tokens.clone()
        tokens[children[1]] = tokens[children[0]]
        return DraftTree(tokens, tree.parent, tree.depth, tree.score, tree.entropy, tree.mask, tree.prefix_len)


@pytest.mark.parametrize("at", [0, 1])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_refuses_a_tree_with_repeated_siblings(peaky_target, at, temperature):
    prompt = random_prompt(peaky_target, 6, 700)
    strategy = RepeatingStrategy(DraftHead(peaky_target.config, seed=3), at)
    with pytest.raises(RuntimeError, match=f"strategy 'repeating' proposed an invalid tree: siblings must carry "
                                           f"distinct tokens: nodes .* \\(children of node {at}\\)"):
        generate(peaky_target, prompt, strategy, SamplingConfig(temperature=temperature, seed=0), max_new_tokens=8)
