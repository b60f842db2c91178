"""generate() on a tiny target: greedy exactness, stopping and trimming, drafter alignment, bad input, stats."""

from __future__ import annotations

import copy
import json
import math
import threading
import time

import pytest
import torch

from taps_ray.config import SamplingConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec import decoder
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import SingleStrategy, Strategy, VanillaStrategy
from taps_ray.spec.stats import (
    StepRecord,
    acceptance_length,
    depth_counts,
    mean_tau,
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


def test_mean_tau():
    assert mean_tau([2.0, None, math.nan, 4.0]) == 3.0 and math.isnan(mean_tau([None]))
    assert math.isnan(acceptance_length(0, 0)) and acceptance_length(7, 2) == 3.5


class SpacedIds:
    """A tokenizer whose text is the ids joined by spaces."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture
def spelled(peaky_target):
    target = copy.copy(peaky_target)
    target.tokenizer = SpacedIds()
    return target


def oracle(target, prompt: torch.Tensor, new: int) -> OracleStrategy:
    """An oracle strategy over the target's own greedy continuation of ``prompt``."""
    reference = generate(target, prompt, max_new_tokens=new).token_ids
    return OracleStrategy(torch.cat([prompt, torch.tensor(reference)]), target.vocab_size, depth=4, seed=1)


class Seen:
    """A step observer that keeps what it is handed and ends the loop after ``end_after`` calls."""

    def __init__(self, end_after: int | None = None, reason: str = "mine"):
        self.tokens, self.texts, self.calls, self.end_after, self.reason = [], [], 0, end_after, reason

    def on_step(self, tokens, text):
        self.tokens.append(tokens)
        self.texts.append(text)
        self.calls += 1
        return self.reason if self.calls == self.end_after else None


@pytest.mark.parametrize("spec", [False, True])
def test_a_stop_sequence_ends_the_loop_after_the_token_that_completes_it(spelled, spec):
    """The loop cuts the output after the token that completes the stop sequence, its text before it, and the
    last step's appended count to the tokens it kept; speculative and plain decoding end at the same token."""
    prompt = random_prompt(spelled, 6, 3)
    full = generate(spelled, prompt, max_new_tokens=40)
    stop = " ".join(map(str, full.token_ids[7:9]))
    n = next(k for k in range(1, 41) if stop in SpacedIds().decode(full.token_ids[:k]))
    strategy = oracle(spelled, prompt, 40) if spec else None
    observer = Seen()
    result = generate(spelled, prompt, strategy, max_new_tokens=40, stop=[stop], observer=observer)
    assert result.finish_reason == "stop" and result.token_ids == full.token_ids[:n]
    text = SpacedIds().decode(full.token_ids[:n])
    assert result.text == text[:text.index(stop)]
    assert sum(s.appended for s in result.steps) == n - 1, "the first token is not a step's"
    assert [t for part in observer.tokens for t in part] == result.token_ids
    assert "".join(observer.texts) == result.text[:len("".join(observer.texts))]


def test_the_observer_sees_every_token_and_may_end_the_loop(spelled):
    prompt = random_prompt(spelled, 6, 4)
    full = generate(spelled, prompt, oracle(spelled, prompt, 30), max_new_tokens=30)
    seen = Seen()
    again = generate(spelled, prompt, oracle(spelled, prompt, 30), max_new_tokens=30, observer=seen)
    assert again.token_ids == full.token_ids and again.finish_reason == full.finish_reason
    assert [t for part in seen.tokens for t in part] == full.token_ids and seen.calls == len(full.steps) + 1
    assert "".join(seen.texts) == full.text
    ended = Seen(end_after=3, reason="mine")
    cut = generate(spelled, prompt, oracle(spelled, prompt, 30), max_new_tokens=30, observer=ended)
    assert cut.finish_reason == "mine" and len(cut.steps) == 2
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) == sum(map(len, ended.tokens))


def test_cancel_and_deadline_end_the_loop_before_the_next_step(spelled):
    prompt = random_prompt(spelled, 6, 5)
    full = generate(spelled, prompt, max_new_tokens=20)
    cancel = threading.Event()

    class CancelAfter(Seen):
        def on_step(self, tokens, text):
            super().on_step(tokens, text)
            if self.calls == 4:
                cancel.set()

    result = generate(spelled, prompt, max_new_tokens=20, observer=CancelAfter(), cancel=cancel)
    assert result.finish_reason == "cancelled" and result.token_ids == full.token_ids[:4]
    late = generate(spelled, prompt, oracle(spelled, prompt, 20), max_new_tokens=20,
                    deadline=time.monotonic() - 1.0)
    assert late.finish_reason == "timeout" and late.token_ids == full.token_ids[:1] and not late.steps


def test_a_node_limit_cuts_trees_to_their_best_nodes_and_one_node_skips_drafting(peaky_target, monkeypatch):
    """Limit 4 for 5 steps, then 1 for 5, then none: the verified trees are the proposed trees' best 4 nodes,
    the cuts are recorded per step, the limit-1 steps are plain and never ask the strategy, and the output
    stays vanilla's."""
    proposed, verified = [], []
    run_tree = decoder.run_tree
    monkeypatch.setattr(decoder, "run_tree", lambda target, tree, cache, layers=None: verified.append(tree) or run_tree(target, tree, cache, layers))
    prompt = random_prompt(peaky_target, 6, 2)
    vanilla = generate(peaky_target, prompt, max_new_tokens=40)
    limits = iter([4] * 5 + [1] * 5)
    strategy = oracle(peaky_target, prompt, 40)
    asked = []
    propose = strategy.propose
    strategy.propose = lambda state: asked.append(state.step) or proposed.append(propose(state)) or proposed[-1]
    result = generate(peaky_target, prompt, strategy, max_new_tokens=40, node_limit=lambda: next(limits, 1000))
    assert result.token_ids == vanilla.token_ids
    sizes = [s.tree_size for s in result.steps]
    assert sizes[:5] == [4] * 5 and sizes[5:10] == [1] * 5
    assert all(s.shed > 0 for s in result.steps[:5]) and all(s.load_plain for s in result.steps[5:10])
    assert not any(s.load_plain or s.shed for s in result.steps[10:])
    assert 5 not in asked and 9 not in asked and 10 in asked
    for full, cut in zip(proposed[:5], verified[:5]):
        assert torch.equal(cut.tokens, full.top(4).tokens) and torch.equal(cut.parent, full.top(4).parent)
    assert all(torch.equal(full.tokens, tree.tokens) for full, tree in zip(proposed[5:], verified[5:]))


def test_a_strategy_notes_reach_the_step_record(peaky_target):
    class Noting(SingleStrategy):
        def propose(self, state):
            state.notes["seen_step"] = state.step
            return super().propose(state) if state.step % 2 else None

    drafter = DraftHead(peaky_target.config, seed=0).eval()
    result = generate(peaky_target, random_prompt(peaky_target, 6, 1), Noting(drafter, TREES[0]), max_new_tokens=12)
    assert [s.meta["seen_step"] for s in result.steps] == list(range(len(result.steps)))


def test_bad_stop_sequences_are_refused(peaky_target, spelled):
    prompt = random_prompt(peaky_target, 6, 1)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(peaky_target, prompt, max_new_tokens=4, stop=["x"])
    for bad in ("x", [""], [3]):
        with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
            generate(spelled, prompt, max_new_tokens=4, stop=bad)


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
