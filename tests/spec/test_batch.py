"""Batched verification (taps_ray/spec/batch.py): one forward over many requests' steps changes nothing.

``forward_batch`` is checked against one ``TargetModel.forward`` per call (logits, hidden states and
the extended caches), on a full-attention and a sliding-window target; ``generate_together`` against
``generate`` alone (greedy token for token, fp32) with batches that really formed; and speculative
sampling in batches against the target's exact law (chi-square with a power control, as in
test_sampling.py).
"""

from __future__ import annotations

import collections
import copy
import threading

import pytest
import torch
from transformers import DynamicCache

from taps_ray.config import SamplingConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec.batch import (
    BatchingTarget,
    DraftBatcher,
    DraftCall,
    ForwardBatcher,
    ForwardCall,
    draft_forward_batch,
    forward_batch,
    generate_together,
    head_batch,
)
from taps_ray.spec.decoder import generate
from taps_ray.spec.draft_compute import DraftHeadProduct, draft_log_probs
from taps_ray.spec.protocol import SingleStrategy
from taps_ray.spec.tree import DrafterState, build_tree, draft_tree
from taps_ray.spec.verify import tree_attention
from tests.serving.helpers import same_tree
from tests.spec.spec_helpers import (
    chi_square_p_value,
    joint_law,
    next_token_laws,
    peaky_tiny_target,
    random_prompt,
    sharp_eagle3,
)

TREE = TreeConfig(depth=3, top_k=3, total_tokens=10, lookup_tokens=0)


def _prefilled(target, length: int, seed: int):
    ids = random_prompt(target, length, seed=seed)
    cache = target.new_cache()
    target.prefill(ids[None], cache)
    return ids, cache


def _calls(target, seed: int = 0) -> list[ForwardCall]:
    """Three requests of prefix lengths 5, 9, 7: a 6-node tree, a plain step and a 3-node chain."""
    calls = []
    _, cache = _prefilled(target, 5, seed)
    tree = build_tree([3, 4, 5, 6, 7, 8], [-1, 0, 0, 1, 1, 2], [0, -1, -2, -1.5, -2.5, -3], prefix_len=5)
    mask, positions = tree_attention(tree, target.dtype)
    calls.append(ForwardCall(tree.tokens, positions[0], cache, mask[0, 0]))
    _, cache = _prefilled(target, 9, seed + 1)
    calls.append(ForwardCall(torch.tensor([11]), torch.tensor([9]), cache))
    _, cache = _prefilled(target, 7, seed + 2)
    chain = build_tree([1, 2, 9], [-1, 0, 1], [0, -1, -2], prefix_len=7)
    mask, positions = tree_attention(chain, target.dtype)
    calls.append(ForwardCall(chain.tokens, positions[0], cache, mask[0, 0]))
    return calls


def _solo(target, call: ForwardCall):
    mask = None if call.mask is None else call.mask[None, None]
    return target.forward(call.tokens[None], call.positions[None], call.cache, mask)


@pytest.mark.parametrize("window", [None, 4])
def test_forward_batch_equals_one_forward_per_call(window):
    target = peaky_tiny_target(3, vocab_size=64, hidden_size=32) if window is None else _sliding_target(window)
    batched_calls, solo_calls = _calls(target), _calls(target)
    outputs = forward_batch(target, batched_calls)
    for call, solo_call, out in zip(batched_calls, solo_calls, outputs):
        expected = _solo(target, solo_call)
        assert out.logits.shape == expected.logits.shape and out.hidden.shape == expected.hidden.shape
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.hidden, expected.hidden, rtol=1e-4, atol=1e-4)
        assert call.cache.get_seq_length() == solo_call.cache.get_seq_length()
        for mine, theirs in zip(call.cache.layers, solo_call.cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)


def _sliding_target(window: int):
    from transformers import MistralConfig, MistralForCausalLM

    from taps_ray.models.target import TargetModel

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=window)
    return TargetModel(MistralForCausalLM(config).eval(), tokenizer=None, name="tiny-mistral")


@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_forward_batch_returns_each_call_the_layers_it_asked_for(engine):
    """Calls asking for an EAGLE-3 drafter's layers, for a union with the last hidden state, or for nothing
    share one forward; each gets the features of its own layers, as its forward alone would."""
    target = peaky_tiny_target(3, vocab_size=64, hidden_size=32, layers=6)
    if engine == "hf":
        target.engine = None
    asks = [(2, 3, 3), None, (6, 2, 3)]
    batched_calls, solo_calls = _calls(target), _calls(target)
    for call, solo, layers in zip(batched_calls, solo_calls, asks):
        call.layers = solo.layers = layers
    for call, solo, out in zip(batched_calls, solo_calls, forward_batch(target, batched_calls)):
        mask = None if solo.mask is None else solo.mask[None, None]
        expected = target.forward(solo.tokens[None], solo.positions[None], solo.cache, mask, layers=solo.layers)
        assert (out.features is None) == (call.layers is None)
        if call.layers is not None:
            assert out.features.shape == (1, call.tokens.numel(), 3 * 32)
            torch.testing.assert_close(out.features, expected.features, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.drafter_features, expected.drafter_features, rtol=1e-4, atol=1e-4)


def test_forward_batch_of_one_is_the_target_forward(peaky_target):
    (call,), (solo,) = _calls(peaky_target)[:1], _calls(peaky_target)[:1]
    out = forward_batch(peaky_target, [call])[0]
    assert torch.equal(out.logits, _solo(peaky_target, solo).logits)


def test_the_packed_forward_prefills_in_the_batch_and_the_padded_one_refuses_to(peaky_target):
    calls = _calls(peaky_target)
    prompt = torch.tensor([1, 2, 3])
    calls[1] = ForwardCall(prompt, torch.arange(3), peaky_target.new_cache(8))
    out = forward_batch(peaky_target, calls)[1]
    alone = peaky_target.prefill(prompt[None], peaky_target.new_cache(8))
    torch.testing.assert_close(out.logits, alone.logits, rtol=0, atol=1e-5)
    assert calls[1].cache.get_seq_length() == 3
    calls[1] = ForwardCall(prompt, torch.arange(3), DynamicCache())
    with pytest.raises(ValueError, match="empty cache"):
        forward_batch(peaky_target, calls)


def test_greedy_requests_decoded_together_equal_each_decoded_alone(peaky_target):
    prompts = [random_prompt(peaky_target, n, seed=s) for s, n in enumerate([6, 11, 4, 9, 14, 7])]
    strategies = [None, SingleStrategy(DraftHead(peaky_target.config, seed=1), TREE), None,
                  SingleStrategy(DraftHead(peaky_target.config, seed=2), TREE),
                  SingleStrategy(DraftHead(peaky_target.config, seed=1), TREE), None]
    alone = [generate(peaky_target, p, copy.deepcopy(s), max_new_tokens=24, eos_token_ids=frozenset())
             for p, s in zip(prompts, strategies)]
    together, batcher = generate_together(peaky_target, prompts, strategies, max_batch=4, wait_s=0.05,
                                          max_new_tokens=24, eos_token_ids=frozenset())
    for mine, theirs in zip(together, alone):
        assert mine.token_ids == theirs.token_ids
        assert mine.accept_lengths == theirs.accept_lengths
    assert max(batcher.sizes) > 1, f"no batch formed: {dict(batcher.sizes)}"
    assert max(batcher.sizes) <= 4
    prefills = len(prompts)
    assert sum(size * count for size, count in batcher.sizes.items()) == sum(len(r.steps) for r in together) + prefills


@pytest.mark.slow
def test_eagle3_and_eagle2_requests_decoded_together_equal_each_decoded_alone():
    target = peaky_tiny_target(2, layers=8)
    prompts = [random_prompt(target, n, seed=s) for s, n in enumerate([6, 11, 4, 9])]
    strategies = [SingleStrategy(sharp_eagle3(target, 1), TREE), SingleStrategy(DraftHead(target.config, seed=2), TREE),
                  None, SingleStrategy(sharp_eagle3(target, 3), TREE)]
    alone = [generate(target, p, copy.deepcopy(s), max_new_tokens=20, eos_token_ids=frozenset())
             for p, s in zip(prompts, strategies)]
    together, batcher = generate_together(target, prompts, strategies, max_batch=4, wait_s=0.05,
                                          max_new_tokens=20, eos_token_ids=frozenset())
    vanilla = [generate(target, p, None, max_new_tokens=20, eos_token_ids=frozenset()) for p in prompts]
    for mine, theirs, plain in zip(together, alone, vanilla):
        assert mine.token_ids == theirs.token_ids == plain.token_ids
        assert mine.accept_lengths == theirs.accept_lengths
    assert max(batcher.sizes) > 1, f"no batch formed: {dict(batcher.sizes)}"


def test_a_failing_batch_fails_every_request_in_it(peaky_target):
    class Broken:
        def __getattr__(self, name):
            return getattr(peaky_target, name)

        def forward_hidden(self, *args, **kwargs):
            raise RuntimeError("device lost")

        forward_segments = forward_hidden

    batcher = ForwardBatcher(Broken(), max_batch=2, wait_s=1.0)
    errors = []
    barrier = threading.Barrier(2)

    def run(seed):
        call = _calls(peaky_target, seed)[0]
        barrier.wait()
        try:
            batcher.forward(call.tokens[None], call.positions[None], call.cache, call.mask[None, None])
        except RuntimeError as err:
            errors.append(str(err))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (0, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == ["device lost", "device lost"]
    assert batcher.sizes == collections.Counter({2: 1})


def test_batcher_checks_its_arguments(peaky_target):
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        ForwardBatcher(peaky_target, max_batch=0)
    with pytest.raises(ValueError, match="wait_s must be >= 0"):
        ForwardBatcher(peaky_target, wait_s=-1)
    batched = BatchingTarget(peaky_target, ForwardBatcher(peaky_target))
    assert batched.vocab_size == peaky_target.vocab_size
    with pytest.raises(ValueError, match="one request"):
        batched.forward(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long),
                        peaky_target.new_cache())


V = 16


@pytest.mark.slow
def test_sampling_in_batches_follows_the_target_law():
    """Requests sampled 8 at a time (a fresh drafter's trees, seeds 0..n-1): their first three tokens
    follow the exact joint law, and not a nearby wrong one (temperature 0.8 instead of 1.0)."""
    target = peaky_tiny_target(5, vocab_size=V, hidden_size=32, scale=1.2)
    prefix = random_prompt(target, 6, seed=11)
    tree = TreeConfig(depth=2, top_k=3, total_tokens=8, lookup_tokens=0)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    sizes: collections.Counter = collections.Counter()
    n, group = 1200, 8
    for start in range(0, n, group):
        results, batcher = generate_together(
            target, [prefix] * group, [SingleStrategy(DraftHead(target.config, seed=4), tree) for _ in range(group)],
            [SamplingConfig(temperature=1.0, seed=seed) for seed in range(start, start + group)], max_batch=group,
            wait_s=0.05, max_new_tokens=3, eos_token_ids=frozenset(), collect_entropy=False)
        for result in results:
            t1, t2, t3 = result.token_ids
            counts[(t1 * V + t2) * V + t3] += 1
        sizes.update(batcher.sizes)
    assert max(sizes) > 1
    joint = joint_law(next_token_laws(target, prefix, 3, 1.0))
    p_value = chi_square_p_value(counts, joint)
    assert p_value > 1e-3, f"batched speculative samples do not follow the target law (p = {p_value:.2e})"
    control = chi_square_p_value(counts, joint_law(next_token_laws(target, prefix, 3, 0.8)))
    assert control < 1e-3, f"the test cannot tell a nearby wrong law apart (p = {control:.2e})"


def _draft_calls(target, drafter, seed: int = 0) -> list[DraftCall]:
    """Three sessions: a fresh one committing 6 prompt pairs (empty cache), one with 5 committed pairs
    running 2 more, one with 8 running a 3-node frontier under a tree mask."""
    g = torch.Generator().manual_seed(seed)
    H = target.hidden_size

    def pairs(n):
        return target.embed_tokens(torch.randint(2, target.vocab_size, (n,), generator=g)), torch.randn(n, H, generator=g)

    calls = []
    embeds, features = pairs(6)
    calls.append(DraftCall(drafter, embeds, features, torch.arange(6), drafter.new_cache()))
    for past, n, tree in ((5, 2, False), (8, 3, True)):
        cache = drafter.new_cache()
        embeds, features = pairs(past)
        drafter(embeds[None], features[None], torch.arange(past)[None], cache)
        embeds, features = pairs(n)
        mask = None
        if tree:
            allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), torch.eye(n, dtype=torch.bool)], 1)
            mask = torch.zeros(n, past + n).masked_fill(~allowed, torch.finfo(torch.float32).min)
        calls.append(DraftCall(drafter, embeds, features, torch.full((n,), past) if tree else torch.arange(past, past + n),
                               cache, mask))
    return calls


def test_draft_forward_batch_equals_one_drafter_forward_per_call(peaky_target):
    drafter = DraftHead(peaky_target.config, seed=3)
    batched, solo = _draft_calls(peaky_target, drafter), _draft_calls(peaky_target, drafter)
    outputs = draft_forward_batch(batched)
    for call, alone, out in zip(batched, solo, outputs):
        mask = None if alone.mask is None else alone.mask[None, None]
        expected = drafter(alone.embeds[None], alone.features[None], alone.positions[None], alone.cache, mask)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        assert call.cache.get_seq_length() == alone.cache.get_seq_length()
        torch.testing.assert_close(call.cache.layers[0].keys, alone.cache.layers[0].keys, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one drafter"):
        draft_forward_batch([*batched[:1], DraftCall(DraftHead(peaky_target.config, seed=4), *list(vars(batched[1]).values())[1:])])


def test_head_batch_groups_calls_by_head():
    g = torch.Generator().manual_seed(0)
    heads = [DraftHeadProduct(torch.randn(20, 8, generator=g), "dense"),
             DraftHeadProduct(torch.randn(12, 8, generator=g), "dense")]
    calls = [(heads[i % 2], torch.randn(1 + i, 8, generator=g)) for i in range(5)]
    for (head, hidden), got in zip(calls, head_batch(calls)):
        for mine, theirs in zip(got, draft_log_probs(head, hidden)):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_sessions_drafting_together_draft_the_trees_each_drafts_alone(peaky_target):
    """Six sessions of one drafter (vocabulary reduced to 200 ids) on six threads through one
    DraftBatcher, three rounds of add-then-draft: every tree equals the one drafted alone, and the
    drafter's forwards and head products ran in batches."""
    drafter = DraftHead(peaky_target.config, draft_to_target=torch.randperm(peaky_target.vocab_size)[:200], seed=5)
    prompts = [random_prompt(peaky_target, n, seed=s) for s, n in enumerate([5, 9, 7, 12, 6, 8])]
    features = [peaky_target.hidden_states(p[None])[0] for p in prompts]
    compute = DraftBatcher(max_batch=6, wait_s=0.05, expected=lambda: 6)
    alone = [DrafterState(drafter) for _ in prompts]
    together = [DrafterState(drafter, compute) for _ in prompts]
    trees: dict[int, list] = {}

    def run(i, states, out):
        for round_ in range(3):
            if round_ == 0:
                states[i].add(prompts[i][1:], features[i][:-1])
            else:
                tree = out[(i, round_ - 1)]
                states[i].add(tree.tokens[1:3], torch.randn(2, peaky_target.hidden_size,
                                                            generator=torch.Generator().manual_seed(i * 10 + round_)))
            out[(i, round_)] = draft_tree(drafter, peaky_target, states[i], TREE)

    expected: dict = {}
    for i in range(len(prompts)):
        run(i, alone, expected)
    threads = [threading.Thread(target=run, args=(i, together, trees)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert trees.keys() == expected.keys()
    for key in expected:
        assert same_tree(trees[key], expected[key]), f"session {key[0]} round {key[1]}"
    assert max(compute.forwards.sizes) > 1 and max(compute.heads.sizes) > 1
