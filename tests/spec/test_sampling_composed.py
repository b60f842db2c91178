"""Every composed strategy is lossless at T > 0, and verification wastes no acceptance.

A 1-layer peaky Llama with 8 tokens and a fixed prefix; the first four generated tokens have an exact
joint law over 4096 cells (:func:`~tests.spec.spec_helpers.next_token_laws`). Each strategy runs over
two specialists with different reduced draft vocabularies (single, routed, merged) or two full-vocabulary
drafters (averaged), with trees of two levels and six nodes: step 1 can accept a depth-1 or depth-2
leaf, whose bonus (token 3 or 4) is inside the observed window, and step 2 runs on a compacted cache.

Threshold and power as in ``test_sampling.py``: fixed seeds, chi-square p > 1e-3 against the exact
law, and the same samples must be rejected (p < 1e-3) against a nearby wrong law (another
temperature, or the law without top-p / top-k). Two sampler bugs run through ``generate`` must be
caught: a bonus at an accepted leaf drawn at the leaf's parent (chi-square), and a lossless but
wasteful verifier that only ever tries the best-scored child (efficiency: the probability of
accepting a child of the root must equal the target mass on the root's children).
"""

from __future__ import annotations

import collections

import pytest
import torch

import taps_ray.spec.decoder as decoder
from taps_ray.config import SamplingConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.verify import Verdict, process_logits, verify_sampling
from tests.conftest import make_tiny_target
from tests.spec.spec_helpers import (
    chi_square_p_value,
    joint_law,
    make_peaky,
    next_token_laws,
    random_prompt,
    sharp_eagle3,
)

V = 8
M = 4
TARGET = make_peaky(make_tiny_target(3, vocab_size=V, hidden_size=32, layers=1), 3, scale=1.5)
PREFIX = random_prompt(TARGET, 5, seed=2)
TREE = TreeConfig(depth=1, top_k=3, total_tokens=6, lookup_tokens=0)
P_VALUE = 1e-3
Z_MAX = 3.3


def _drafter(vocab: list[int] | None, seed: int) -> DraftHead:
    head = DraftHead(TARGET.config, draft_to_target=None if vocab is None else torch.tensor(vocab), seed=seed).eval()
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() == 2:
                param.mul_(3.0)
    return head


SPECIALISTS = {"low": _drafter([0, 1, 2, 3, 4, 5], 1), "high": _drafter([2, 3, 4, 5, 6, 7], 2)}
GENERALISTS = {"a": _drafter(None, 3), "b": _drafter(None, 4)}


class FirstTree:
    """Wraps a strategy; records the root's children (tokens [c] in score order) of each request's first tree."""

    def __init__(self, inner):
        self.inner, self.name, self.children = inner, inner.name, []
        self.feature_layers = getattr(inner, "feature_layers", None)

    def start(self, target, tokens, features):
        self.inner.start(target, tokens, features)
        self.first = True

    def propose(self, state):
        tree = self.inner.propose(state)
        if self.first:
            kids = (tree.parent == 0).nonzero().squeeze(1)
            self.children.append(tree.tokens[kids[tree.score[kids].argsort(descending=True, stable=True)]])
            self.first = False
        return tree

    def advance(self, tokens, features):
        self.inner.advance(tokens, features)


class Draws:
    """n requests of M tokens through ``generate``: ``counts`` [V ** M] of (t1..t4), ``steps`` per request,
    ``first`` [n] (t1) and ``children`` (the first tree's root children, best-scored first) per request."""

    def __init__(self, strategy, sampling: dict, n: int, target=TARGET, prefix=PREFIX):
        recorder = FirstTree(strategy)
        cells, self.steps, first = collections.Counter(), [], []
        for seed in range(n):
            result = decoder.generate(target, prefix, recorder, SamplingConfig(seed=seed, **sampling),
                                      max_new_tokens=M, eos_token_ids=frozenset(), collect_entropy=False)
            cells[sum(t * V ** (M - 1 - i) for i, t in enumerate(result.token_ids))] += 1
            self.steps.append(result.steps)
            first.append(result.token_ids[0])
        self.counts = torch.zeros(V ** M, dtype=torch.float64)
        for cell, count in cells.items():
            self.counts[cell] = count
        self.first, self.children = torch.tensor(first), recorder.children

    def leaf_bonuses(self) -> int:
        """Steps whose accepted path ended at a leaf and kept the bonus drawn there."""
        return sum(1 for run in self.steps for s in run
                   if s.accepted >= 1 and not bool(s.rejected) and s.appended == s.accepted + 1)

    def root_acceptance_z(self, p2: torch.Tensor, best_only: bool = False) -> float:
        """z-score of the number of first steps that accepted a child of the root against its expectation
        sum_i p2[t1_i, children_i].sum(), the target mass on the children (``best_only``: the mass of the
        best-scored child alone, all a verifier that tries one child per node can accept)."""
        accepted = torch.tensor([float(run[0].accepted >= 1) for run in self.steps], dtype=torch.float64)
        mass = torch.stack([p2[t, kids[:1] if best_only else kids].sum() for t, kids in
                            zip(self.first.tolist(), self.children)]).double()
        return float((accepted.sum() - mass.sum()) / (mass * (1 - mass)).sum().sqrt())


def bonus_at_the_parent(tree, logits, temperature, top_p=1.0, top_k=0, generator=None) -> Verdict:
    """A plausible bug: at an accepted leaf the bonus is drawn from the leaf's parent's law."""
    verdict = verify_sampling(tree, logits, temperature, top_p, top_k, generator)
    last = verdict.path[-1]
    if verdict.accepted and not bool((tree.parent == last).any()):
        probs = process_logits(logits[tree.parent[last]], temperature, top_p, top_k)
        bonus = torch.multinomial(probs, 1, generator=generator)
        return Verdict(verdict.path, torch.cat([verdict.tokens[:-1], bonus]), verdict.rejected)
    return verdict


def best_child_only(tree, logits, temperature, top_p=1.0, top_k=0, generator=None) -> Verdict:
    """Lossless but wasteful: one draw y ~ p per node, accepted only when it is the best-scored child."""
    choice = torch.multinomial(process_logits(logits, temperature, top_p, top_k), 1, generator=generator).squeeze(1)
    node, path = 0, [0]
    while (kids := (tree.parent == node).nonzero().squeeze(1)).numel():
        best = int(kids[tree.score[kids].argmax()])
        if int(tree.tokens[best]) != int(choice[node]):
            break
        node = best
        path.append(node)
    path = torch.tensor(path)
    return Verdict(path, torch.cat([tree.tokens[path[1:]], choice[node][None]]), torch.tensor(-1))


def make(name: str):
    drafters = GENERALISTS if name == "averaged" else SPECIALISTS
    return build_strategy(name, drafters, TREE, probe_steps=1)


def laws(sampling: dict, target=TARGET, prefix=PREFIX) -> list[torch.Tensor]:
    return next_token_laws(target, prefix, M, sampling["temperature"], sampling.get("top_p", 1.0),
                           sampling.get("top_k", 0))


def check_used_every_drafter(name: str, draws: Draws) -> None:
    """The composition is not degenerate: step routing picked each specialist, request routing drafted
    with its decision alone after the probe, merging verified nodes of both."""
    metas = [s.meta for run in draws.steps for s in run]
    if name.endswith(":step"):
        assert {m["route"] for m in metas} == set(SPECIALISTS)
    if name.endswith(":request"):
        assert any(not m["probe"] and m["route"] == m["decision"] for m in metas)
    if name.startswith("merged"):
        assert any(bool((m["node_sources"] > 0).all()) for m in metas)
    if name == "merged:budget":
        assert any(m["union_size"] > m["verified_size"] for m in metas)


@pytest.mark.slow
@pytest.mark.parametrize("name, sampling, wrong", [
    ("single", {"temperature": 1.0}, {"temperature": 0.8}),
    ("averaged", {"temperature": 0.8, "top_k": 3}, {"temperature": 0.8}),
    ("routed:confidence:step", {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7}),
    ("routed:confidence:request", {"temperature": 1.0, "top_k": 4}, {"temperature": 1.0}),
    ("routed:entropy:step", {"temperature": 1.0}, {"temperature": 0.8}),
    ("routed:entropy:request", {"temperature": 0.7, "top_p": 0.8}, {"temperature": 0.7}),
    ("merged:union", {"temperature": 0.9, "top_p": 0.85}, {"temperature": 0.9}),
    ("merged:budget", {"temperature": 1.0, "top_k": 4}, {"temperature": 1.0}),
])
def test_first_tokens_follow_the_target_law(name, sampling, wrong):
    n = 400
    exact = laws(sampling)
    joint = joint_law(exact)
    draws = Draws(make(name), sampling, n)
    assert draws.counts[joint == 0].sum() == 0, "a token outside the top-p / top-k support was generated"
    p_value = chi_square_p_value(draws.counts, joint)
    assert p_value > P_VALUE, f"{name}: samples do not follow the target law (p = {p_value:.2e})"
    control = chi_square_p_value(draws.counts, joint_law(laws(wrong)))
    assert control < P_VALUE, f"{name}: the test cannot tell a nearby wrong law apart (p = {control:.2e})"
    assert draws.leaf_bonuses() >= n // 10, "too few bonuses drawn at an accepted leaf were observed"
    z = draws.root_acceptance_z(exact[1])
    assert abs(z) < Z_MAX, f"{name}: P(accept a child of the root) != target mass on the children (z = {z:.1f})"
    check_used_every_drafter(name, draws)


DEEP = make_peaky(make_tiny_target(3, vocab_size=V, hidden_size=32, layers=5), 3, scale=1.5)
DEEP_PREFIX = random_prompt(DEEP, 5, seed=2)


def eagle3_strategy(name: str):
    """EAGLE-3 heads on the 5-layer target: two full-vocabulary heads (single takes the first; averaged), one
    beside a head on a reduced vocabulary (routed), an EAGLE-2 and an EAGLE-3 head on two vocabularies (merged)."""
    low, high = torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([2, 3, 4, 5, 6, 7])
    if name in ("averaged", "single"):
        drafters = {"a": sharp_eagle3(DEEP, 3, 1.0), "b": sharp_eagle3(DEEP, 4, 1.0)}
    elif name == "merged:union":
        eagle2 = DraftHead(DEEP.config, draft_to_target=low, seed=1).eval()
        with torch.no_grad():
            for param in eagle2.parameters():
                param.mul_(3.0) if param.dim() == 2 else None
        drafters = {"low": eagle2, "high": sharp_eagle3(DEEP, 2, 1.0, high)}
    else:
        drafters = {"a": sharp_eagle3(DEEP, 3, 1.0), "high": sharp_eagle3(DEEP, 2, 1.0, high)}
    return build_strategy(name, drafters, TREE, probe_steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("name, sampling, wrong", [
    ("single", {"temperature": 1.0}, {"temperature": 0.8}),
    ("averaged", {"temperature": 0.8, "top_k": 3}, {"temperature": 0.8}),
    ("routed:confidence:step", {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7}),
    ("merged:union", {"temperature": 0.9, "top_p": 0.85}, {"temperature": 0.9}),
])
def test_eagle3_drafters_keep_the_first_tokens_on_the_target_law(name, sampling, wrong):
    n = 400
    exact = laws(sampling, DEEP, DEEP_PREFIX)
    joint = joint_law(exact)
    draws = Draws(eagle3_strategy(name), sampling, n, DEEP, DEEP_PREFIX)
    assert draws.counts[joint == 0].sum() == 0, "a token outside the top-p / top-k support was generated"
    p_value = chi_square_p_value(draws.counts, joint)
    assert p_value > P_VALUE, f"{name}: samples do not follow the target law (p = {p_value:.2e})"
    control = chi_square_p_value(draws.counts, joint_law(laws(wrong, DEEP, DEEP_PREFIX)))
    assert control < P_VALUE, f"{name}: the test cannot tell a nearby wrong law apart (p = {control:.2e})"
    assert draws.leaf_bonuses() >= n // 10, "too few bonuses drawn at an accepted leaf were observed"
    z = draws.root_acceptance_z(exact[1])
    assert abs(z) < Z_MAX, f"{name}: P(accept a child of the root) != target mass on the children (z = {z:.1f})"


@pytest.mark.slow
def test_a_bonus_drawn_at_the_leafs_parent_is_caught(monkeypatch):
    monkeypatch.setattr(decoder, "verify_sampling", bonus_at_the_parent)
    sampling = {"temperature": 1.0}
    draws = Draws(make("merged:union"), sampling, 300)
    assert draws.leaf_bonuses() >= 30
    p_value = chi_square_p_value(draws.counts, joint_law(laws(sampling)))
    assert p_value < P_VALUE, f"the bonus drawn at the leaf's parent went unnoticed (p = {p_value:.2e})"


@pytest.mark.slow
def test_a_lossless_but_wasteful_verifier_fails_the_efficiency_check(monkeypatch):
    monkeypatch.setattr(decoder, "verify_sampling", best_child_only)
    sampling = {"temperature": 1.0}
    exact = laws(sampling)
    draws = Draws(make("single"), sampling, 300)
    p_value = chi_square_p_value(draws.counts, joint_law(exact))
    assert p_value > P_VALUE, f"trying the best child alone is lossless, yet p = {p_value:.2e}"
    z = draws.root_acceptance_z(exact[1])
    assert z < -Z_MAX, f"accepting only the best child went unnoticed (z = {z:.1f})"
    assert abs(draws.root_acceptance_z(exact[1], best_only=True)) < Z_MAX
