"""Tree verification: attention inputs, greedy walk, rejected child, logits processors, KV compaction."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from taps_ray.spec.decoder import generate
from taps_ray.spec.tree import build_tree
from taps_ray.spec.verify import (
    compact_target,
    process_logits,
    run_tree,
    tree_attention,
    verify_greedy,
    verify_sampling,
)
from tests.spec.spec_helpers import random_prompt

V = 16


def hand_tree():
    """root 5 -> {7 (node 1), 8 (node 2)}; 7 -> 9 (node 3); 8 -> 10 (node 4); 9 -> 11 (node 5)."""
    return build_tree([5, 7, 8, 9, 10, 11], [-1, 0, 0, 1, 2, 3], score=[0, -0.1, -0.2, -0.5, -0.6, -0.9],
                      prefix_len=4)


def logits_with_argmax(argmax: list[int]) -> torch.Tensor:
    logits = torch.randn(len(argmax), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


def test_tree_attention_inputs():
    mask, positions = tree_attention(hand_tree(), torch.float32)
    assert mask.shape == (1, 1, 6, 10) and positions.tolist() == [[4, 5, 5, 6, 6, 7]]
    allowed = mask[0, 0] == 0
    assert bool(allowed[:, :4].all())
    assert allowed[5, 4:].tolist() == [True, True, False, True, False, True]
    assert bool((mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all())


@pytest.mark.parametrize("argmax, path, tokens, rejected", [
    # root picks 7, node 1 picks 9, node 3 picks 12 (its child is 11): stop after node 3, reject node 5
    ([7, 9, 0, 12, 0, 0], [0, 1, 3], [7, 9, 12], 5),
    # root picks 3: nothing accepted, the best-scored root child (node 1) is the rejected one
    ([3, 0, 0, 0, 0, 0], [0], [3], 1),
    # the whole chain to leaf 5 is accepted; bonus from the leaf, nothing rejected
    ([7, 9, 0, 11, 0, 4], [0, 1, 3, 5], [7, 9, 11, 4], -1),
    # second-best root child accepted, its child 10 rejected
    ([8, 0, 2, 0, 0, 0], [0, 2], [8, 2], 4),
])
def test_verify_greedy_walk(argmax, path, tokens, rejected):
    verdict = verify_greedy(hand_tree(), logits_with_argmax(argmax))
    assert verdict.path.tolist() == path
    assert verdict.tokens.tolist() == tokens
    assert int(verdict.rejected) == rejected
    assert verdict.accepted == len(path) - 1


def test_verify_sampling_on_point_masses_is_greedy():
    logits = logits_with_argmax([7, 9, 0, 11, 0, 4]) * 100
    verdict = verify_sampling(hand_tree(), logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert verdict.tokens.tolist() == [7, 9, 11, 4]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 0.8),
                                                       (0.5, 3, 1.0), (1.0, 0, 0.3)])
def test_process_logits_matches_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 2
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(process_logits(logits, temperature, top_p, top_k), torch.softmax(scores, -1))


def test_compaction_equals_prefill_of_accepted_tokens(peaky_target):
    """After verifying a tree whose accepted path is interleaved with rejected nodes, the compacted cache
    equals the cache of a plain prefill of prompt + root + accepted tokens."""
    target = peaky_target
    prompt = random_prompt(target, 10, seed=3)
    truth = generate(target, prompt, max_new_tokens=5).token_ids
    root, chain = truth[0], truth[1:4]
    wrong = [(t + 1) % target.vocab_size for t in chain]
    tokens = [root, wrong[0], chain[0], wrong[1], chain[1], chain[2], wrong[2]]
    parents = [-1, 0, 0, 2, 2, 4, 4]
    tree = build_tree(tokens, parents, prefix_len=prompt.numel())
    cache = target.new_cache()
    target.prefill(prompt[None], cache)
    out = run_tree(target, tree, cache)
    verdict = verify_greedy(tree, out.logits[0])
    assert verdict.path.tolist() == [0, 2, 4, 5]
    assert verdict.tokens.tolist() == truth[1:5]
    compact_target(cache, tree, verdict)
    reference = target.new_cache()
    target.prefill(torch.tensor([*prompt.tolist(), root, *chain])[None], reference)
    assert cache.get_seq_length() == reference.get_seq_length() == prompt.numel() + 4
    for got, want in zip(cache.layers, reference.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)
