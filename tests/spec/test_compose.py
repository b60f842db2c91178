"""TAPS composition: strategy names, lossless greedy decoding with 2 and 3 drafters, per-step routing
records, request-granularity re-checks, trie union and budget pruning."""

from __future__ import annotations

import math

import pytest
import torch

from taps_ray.config import TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec.compose import (
    MergedStrategy,
    RoutedStrategy,
    build_strategy,
    common_support,
    compose_trees,
    tree_signal,
)
from taps_ray.spec.cost import TreeBudget
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import SingleStrategy
from taps_ray.spec.strategy import STRATEGY_NAMES, parse_strategy
from taps_ray.spec.tree import DrafterState, draft_tree
from tests.conftest import make_tiny_target
from tests.spec.spec_helpers import (
    bigram_target,
    oracle_drafter,
    peaky_tiny_target,
    random_prompt,
    sharp_drafter,
    sharp_eagle3,
)

TREE = TreeConfig(depth=3, top_k=4, total_tokens=12, lookup_tokens=0, adaptive=False)
ALL = ["single", "averaged", "routed:confidence", "routed:confidence:request", "routed:entropy",
       "routed:entropy:step", "merged:union", "merged:budget"]


@pytest.fixture(scope="module")
def bigram():
    return bigram_target(0)


@pytest.fixture(scope="module")
def specialists(bigram):
    """Even-token and odd-token specialists plus a random drafter."""
    ids = torch.arange(bigram.vocab_size)
    return {"even": oracle_drafter(bigram, ids[ids % 2 == 0]), "odd": oracle_drafter(bigram, ids[ids % 2 == 1]),
            "noise": sharp_drafter(bigram, 7)}


class Spy:
    """Mixin recording each step's prefix, every drafter's tree and the proposed tree."""

    def propose(self, state):
        self.drafted = {}
        tree = super().propose(state)
        self.log.append({"tokens": state.tokens.clone(), "drafted": self.drafted, "tree": tree})
        return tree

    def draft(self, i, state):
        tree = super().draft(i, state)
        self.drafted[i] = tree
        return tree


class SpyRouted(Spy, RoutedStrategy):
    log: list


class SpyMerged(Spy, MergedStrategy):
    log: list


def spy(cls, drafters: dict, **kwargs):
    strategy = cls(list(drafters.values()), list(drafters), TREE, **kwargs)
    strategy.log = []
    return strategy


@pytest.mark.parametrize("name, canonical", [
    ("vanilla", "vanilla"), ("single", "single"), ("single:math", "single:math"), ("averaged", "averaged"),
    ("averaged:0.25", "averaged:0.25"), ("averaged:1", "averaged:1"), ("routed:confidence", "routed:confidence:step"),
    ("routed:confidence:request", "routed:confidence:request"), ("routed:entropy", "routed:entropy:request"),
    ("routed:entropy:step", "routed:entropy:step"), ("merged:union", "merged:union"),
    ("merged:budget", "merged:budget"),
])
def test_parse_strategy_canonical_names(name, canonical):
    spec = parse_strategy(name)
    assert spec.name == canonical
    assert parse_strategy(spec.name) == spec


@pytest.mark.parametrize("name, message", [
    ("routed", "unknown strategy 'routed'; valid: vanilla, single"),
    ("merged:all", "unknown strategy 'merged:all'; valid: .*merged:budget"),
    ("routed:confidence:turn", "unknown strategy"),
    ("averaged:half", "ALPHA must be a number"),
    ("averaged:1.5", r"alpha must be in \[0, 1\], got 1.5"),
    ("averaged:-0.1", r"alpha must be in \[0, 1\]"),
    ("vanilla:2", "unknown strategy"),
])
def test_parse_strategy_rejects_with_the_valid_names(name, message):
    with pytest.raises(ValueError, match=message):
        parse_strategy(name)
    assert len(STRATEGY_NAMES) == 7


def test_build_strategy_rejects_bad_drafter_sets(bigram):
    a, b, c = (DraftHead(bigram.config, seed=s) for s in range(3))
    other = DraftHead(make_tiny_target(1, hidden_size=32).config, seed=0)
    with pytest.raises(ValueError, match="different targets: hidden_size 64 vs 32"):
        build_strategy("merged:union", [a, other], TREE)
    with pytest.raises(ValueError, match="needs at least 2 drafters, got 1"):
        build_strategy("routed:confidence", [a], TREE)
    with pytest.raises(ValueError, match="sum to 1"):
        build_strategy("averaged", [a, b, c], TREE, weights=[0.5, 0.3, 0.3])
    with pytest.raises(ValueError, match="interpolates two drafters, got 3"):
        build_strategy("averaged:0.3", [a, b, c], TREE)
    with pytest.raises(ValueError, match="no drafter named 'math'"):
        build_strategy("single:math", {"chat": a}, TREE)
    with pytest.raises(ValueError, match="distinct name"):
        build_strategy("merged:union", [a, b], TREE, names=["x", "x"])
    strategy = build_strategy("routed:entropy", {"x": a, "y": DraftHead(make_tiny_target(1).config, seed=1)}, TREE)
    small = make_tiny_target(2, hidden_size=32)
    with pytest.raises(ValueError, match="does not fit target"):
        generate(small, random_prompt(small, 5, 0), strategy, max_new_tokens=4)


def test_averaged_interpolates_weights(bigram):
    a, b = DraftHead(bigram.config, seed=0), DraftHead(bigram.config, seed=1)
    strategy = build_strategy("averaged:0.25", {"a": a, "b": b}, TREE)
    assert isinstance(strategy, SingleStrategy) and strategy.name == "averaged:0.25"
    torch.testing.assert_close(strategy.drafter.fc.weight, 0.25 * a.fc.weight + 0.75 * b.fc.weight)
    uniform = build_strategy("averaged", [a, b, DraftHead(bigram.config, seed=2)], TREE)
    assert uniform.drafter.metadata["weights"] == pytest.approx([1 / 3] * 3)


def test_build_strategy_from_a_list_of_drafters(bigram, specialists):
    strategy = build_strategy("merged:budget", list(specialists.values()), TREE)
    assert isinstance(strategy, MergedStrategy) and strategy.budget and strategy.name == "merged:budget"
    assert build_strategy("routed:entropy", list(specialists.values())[:2], TREE).granularity == "request"


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", ALL)
def test_greedy_output_equals_vanilla(bigram, specialists, name, k):
    prompt = random_prompt(bigram, 6, k)
    vanilla = generate(bigram, prompt, max_new_tokens=48)
    pool = specialists if name != "averaged" else {"oracle": oracle_drafter(bigram), "n1": sharp_drafter(bigram, 1),
                                                   "n2": sharp_drafter(bigram, 2)}
    drafters = dict(list(pool.items())[:k])
    strategy = build_strategy(name, drafters, TREE, probe_steps=1, recheck_every=2)
    spec = generate(bigram, prompt, strategy, max_new_tokens=48)
    assert spec.token_ids == vanilla.token_ids
    assert spec.strategy == parse_strategy(name).name
    assert sum(s.appended for s in spec.steps) + 1 == len(spec.token_ids)
    assert max(spec.accept_lengths) >= 1


@pytest.mark.parametrize("name", ALL)
def test_adaptive_trees_keep_greedy_output_equal_to_vanilla(bigram, specialists, name):
    """Every strategy carries a cost-model budget by default; sizing trees per step never changes the output."""
    prompt = random_prompt(bigram, 6, 3)
    vanilla = generate(bigram, prompt, max_new_tokens=48)
    pool = specialists if name != "averaged" else {"oracle": oracle_drafter(bigram), "n1": sharp_drafter(bigram, 1)}
    strategy = build_strategy(name, pool, TREE.model_copy(update={"adaptive": True}), probe_steps=1)
    assert isinstance(strategy.tree_budget, TreeBudget) and strategy.tree_budget.cost is None
    spec = generate(bigram, prompt, strategy, max_new_tokens=48)
    assert spec.token_ids == vanilla.token_ids
    assert strategy.tree_budget.cost is not None and strategy.tree_budget.chosen
    assert all(s.tree_size <= len(pool) * TREE.total_tokens for s in spec.steps)
    assert build_strategy(name, pool, TREE).__dict__.get("tree_budget") is None


@pytest.mark.parametrize("name", ALL)
def test_greedy_output_equals_vanilla_on_a_contextual_target(peaky_target, name):
    prompt = random_prompt(peaky_target, 7, 11)
    vanilla = generate(peaky_target, prompt, max_new_tokens=30)
    drafters = {f"d{s}": sharp_drafter(peaky_target, s) for s in range(3)}
    spec = generate(peaky_target, prompt, build_strategy(name, drafters, TREE, recheck_every=2), max_new_tokens=30)
    assert spec.token_ids == vanilla.token_ids


@pytest.mark.parametrize("signal", ["confidence", "entropy"])
def test_step_routing_records_every_decision(bigram, specialists, signal):
    strategy = spy(SpyRouted, specialists, signal=signal, granularity="step")
    result = generate(bigram, random_prompt(bigram, 6, 3), strategy, max_new_tokens=40)
    assert len(strategy.log) == len(result.steps) > 5
    for step, entry in zip(result.steps, strategy.log):
        meta = step.meta
        assert meta["probe"] and meta["signal"] == signal and len(entry["drafted"]) == 3
        expected = torch.stack([tree_signal(entry["drafted"][i], signal) for i in range(3)])
        torch.testing.assert_close(meta["signals"], expected)
        best = int(expected.argmax()) if signal == "confidence" else int(expected.argmin())
        assert meta["route_index"] == best and meta["route"] == list(specialists)[best]
        assert entry["tree"] is entry["drafted"][best]
    routes = [s.meta["route"] for s in result.steps]
    assert {"even", "odd"} <= set(routes)


@pytest.mark.parametrize("signal", ["confidence", "entropy"])
def test_routing_prefers_the_drafter_the_target_agrees_with(bigram, signal):
    drafters = {"noise": sharp_drafter(bigram, 3), "oracle": oracle_drafter(bigram)}
    prompt = random_prompt(bigram, 6, 4)
    result = generate(bigram, prompt, build_strategy(f"routed:{signal}:step", drafters, TREE), max_new_tokens=40)
    noise = generate(bigram, prompt, build_strategy("single:noise", drafters, TREE), max_new_tokens=40)
    routes = [s.meta["route"] for s in result.steps]
    assert routes.count("oracle") >= 0.75 * len(routes)
    assert result.tau > noise.tau + 2


def test_request_routing_probes_rechecks_and_keeps_idle_drafters_in_sync(peaky_target):
    drafters = {f"d{s}": sharp_drafter(peaky_target, s) for s in range(3)}
    strategy = spy(SpyRouted, drafters, signal="confidence", granularity="request", probe_steps=2, recheck_every=3)
    prompt = random_prompt(peaky_target, 8, 21)
    vanilla = generate(peaky_target, prompt, max_new_tokens=30)
    result = generate(peaky_target, prompt, strategy, max_new_tokens=30)
    assert result.token_ids == vanilla.token_ids
    probes = [s.meta["probe"] for s in result.steps]
    assert probes == [i % 5 < 2 for i in range(len(probes))]
    for i, (step, entry) in enumerate(zip(result.steps, strategy.log)):
        meta, finite = step.meta, ~step.meta["signals"].isnan()
        assert (meta["decision"] is None) == (i == 0)
        if meta["probe"]:
            assert bool(finite.all()) and len(entry["drafted"]) == 3
        else:
            assert finite.tolist() == [j == meta["route_index"] for j in range(3)]
            assert meta["route"] == meta["decision"] and list(entry["drafted"]) == [meta["route_index"]]
    rechecks = [e for i, e in enumerate(strategy.log) if i >= 5 and probes[i]]
    assert rechecks, "the run must reach a re-check window"
    idle = [j for j in range(3) if j != result.steps[4].meta["route_index"]]
    for entry in rechecks[:1]:
        tokens = entry["tokens"]
        features = peaky_target.hidden_states(tokens[None, :-1])[0]
        for j in idle:
            state = DrafterState(strategy.drafters[j])
            state.add(tokens[1:], features)
            fresh = draft_tree(strategy.drafters[j], peaky_target, state, TREE)
            lazy = entry["drafted"][j]
            assert torch.equal(lazy.tokens, fresh.tokens) and torch.equal(lazy.parent, fresh.parent)
            torch.testing.assert_close(lazy.score, fresh.score, atol=1e-3, rtol=1e-3)


def _paths(tree) -> set[tuple[int, ...]]:
    """Root-to-node token paths of every non-root node."""
    out = set()
    for i in range(1, tree.size):
        nodes = tree.mask[i].nonzero().squeeze(1)
        out.add(tuple(tree.tokens[nodes].tolist()))
    return out


def test_merged_union_is_a_trie_of_all_trees(bigram, specialists):
    strategy = spy(SpyMerged, specialists)
    result = generate(bigram, random_prompt(bigram, 6, 5), strategy, max_new_tokens=30)
    for step, entry in zip(result.steps, strategy.log):
        trees, union = list(entry["drafted"].values()), entry["tree"]
        distinct = set().union(*(_paths(t) for t in trees))
        assert _paths(union) == distinct and union.size == 1 + len(distinct) == step.tree_size
        assert step.meta["union_size"] == union.size <= 1 + 3 * (TREE.total_tokens - 1)
        duplicates = sum(t.size - 1 for t in trees) - len(distinct)
        assert duplicates >= 0 and int(step.meta["shared_nodes"]) <= duplicates
        assert step.meta["node_sources"].tolist() == [t.size - 1 for t in trees]
        assert (union.parent[1:] < torch.arange(1, union.size)).all()


def test_merged_union_of_identical_drafters_is_one_tree(bigram):
    drafter = sharp_drafter(bigram, 2)
    strategy = spy(SpyMerged, {"a": drafter, "b": sharp_drafter(bigram, 2)})
    result = generate(bigram, random_prompt(bigram, 6, 6), strategy, max_new_tokens=20)
    for step, entry in zip(result.steps, strategy.log):
        single = entry["drafted"][0]
        assert step.tree_size == single.size == TREE.total_tokens
        assert int(step.meta["shared_nodes"]) == TREE.total_tokens - 1
        assert torch.equal(entry["tree"].tokens.sort().values, single.tokens.sort().values)


def test_merged_budget_keeps_the_most_confident_ancestor_closed_nodes(bigram, specialists):
    strategy = spy(SpyMerged, specialists, budget=True)
    result = generate(bigram, random_prompt(bigram, 6, 7), strategy, max_new_tokens=30)
    for step, entry in zip(result.steps, strategy.log):
        trees, kept = list(entry["drafted"].values()), entry["tree"]
        assert kept.size == step.tree_size == TREE.total_tokens < step.meta["union_size"]
        assert (kept.parent[1:] >= 0).all() and (kept.parent[1:] < torch.arange(1, kept.size)).all()
        assert torch.equal(kept.depth[1:], kept.depth[kept.parent[1:]] + 1)
        union_paths = {}
        for tree in trees:
            for i in range(1, tree.size):
                path = tuple(tree.tokens[tree.mask[i].nonzero().squeeze(1)].tolist())
                union_paths[path] = max(union_paths.get(path, -math.inf), float(tree.score[i]))
        kept_paths = _paths(kept)
        assert kept_paths <= set(union_paths)
        assert all(p[:-1] in kept_paths for p in kept_paths if len(p) > 2)
        dropped = [s for p, s in union_paths.items() if p not in kept_paths]
        assert min(union_paths[p] for p in kept_paths) >= max(dropped)


def reduced_sharp_drafter(target, vocab: torch.Tensor | None, seed: int) -> DraftHead:
    """:func:`sharp_drafter` ``seed``'s weights with draft vocabulary ``vocab`` (target ids)."""
    head = DraftHead(target.config, draft_to_target=vocab, seed=seed).eval()
    head.load_state_dict(sharp_drafter(target, seed).state_dict())
    return head


def chain_scores(drafter, target, tokens, features, tree, support: torch.Tensor):
    """Brute force: for every node, the drafter run token by token along the node's root path on a fresh
    cache, each draft distribution a softmax over the LM-head rows of ``support`` (target ids). Returns
    the path log-probs [N] and the entropies [N] of the distribution each node was drawn from."""
    head = target.lm_head.weight[support]
    index = {int(t): i for i, t in enumerate(support)}
    scores, entropies = [0.0], [0.0]
    with torch.inference_mode():
        for node in range(1, tree.size):
            path = tree.tokens[tree.mask[node].nonzero().squeeze(1)].tolist()
            cache = drafter.new_cache()
            hidden = drafter(target.embed_tokens(tokens)[None], features[None], torch.arange(tokens.numel())[None],
                             cache)[0, -1]
            score = 0.0
            for step, token in enumerate(path[1:]):
                logp = torch.log_softmax((head @ hidden).float(), -1)
                score += float(logp[index[token]])
                entropy = float(-(logp.exp() * logp).sum())
                position = torch.tensor([[tokens.numel() + step]])
                hidden = drafter(target.embed_tokens(torch.tensor([token]))[None], hidden[None, None], position,
                                 cache)[0, -1]
            scores.append(score)
            entropies.append(entropy)
    return torch.tensor(scores), torch.tensor(entropies)


@pytest.mark.parametrize("support", ["own", "union", "whole"])
def test_tree_scores_and_entropies_are_over_the_support(peaky_target, support):
    ids = torch.arange(peaky_target.vocab_size)
    small, large = ids[(ids % 3 == 0) | (ids < 40)], ids[ids % 2 == 0]
    drafter = reduced_sharp_drafter(peaky_target, small, 5)
    over = {"own": small, "union": torch.cat([small, large]).unique(), "whole": ids}[support]
    prompt = random_prompt(peaky_target, 9, 31)
    tokens, features = prompt[1:], peaky_target.hidden_states(prompt[None])[0, :-1]
    state = DrafterState(drafter)
    state.add(tokens, features)
    cfg = TreeConfig(depth=2, top_k=3, total_tokens=10, lookup_tokens=0, adaptive=False)
    tree = draft_tree(drafter, peaky_target, state, cfg, None if support == "own" else over)
    plain = DrafterState(drafter)
    plain.add(tokens, features)
    assert torch.equal(tree.tokens, draft_tree(drafter, peaky_target, plain, cfg).tokens), "the support moved nodes"
    assert set(tree.tokens[1:].tolist()) <= set(small.tolist())
    scores, entropies = chain_scores(drafter, peaky_target, tokens, features, tree, over)
    torch.testing.assert_close(tree.score, scores, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(tree.entropy, entropies, atol=2e-4, rtol=1e-4)
    assert tree.support is None if support == "whole" else torch.equal(tree.support, over)


def test_routing_signals_are_over_the_union_of_the_vocabularies(peaky_target):
    ids = torch.arange(peaky_target.vocab_size)
    drafters = {"narrow": reduced_sharp_drafter(peaky_target, ids[ids < 64], 1),
                "wide": reduced_sharp_drafter(peaky_target, ids[ids >= 32], 1)}
    strategy = spy(SpyRouted, drafters, signal="confidence", granularity="step")
    assert torch.equal(strategy.support, ids)
    result = generate(peaky_target, random_prompt(peaky_target, 6, 9), strategy, max_new_tokens=12)
    for step, entry in zip(result.steps, strategy.log):
        trees = [entry["drafted"][i] for i in range(2)]
        assert all(t.support is None for t in trees)
        torch.testing.assert_close(step.meta["signals"], torch.stack([tree_signal(t, "confidence") for t in trees]))
    prompt = random_prompt(peaky_target, 6, 9)
    features = peaky_target.hidden_states(prompt[None])[0, :-1]
    narrow, wide = [], []
    for head, out in zip(drafters.values(), (narrow, wide)):
        state = DrafterState(head)
        state.add(prompt[1:], features)
        out.append(draft_tree(head, peaky_target, state, TREE))
    (narrow,), (wide,) = narrow, wide
    with pytest.raises(ValueError, match=r"cannot route between drafters 'narrow' and 'wide': .*64 target ids vs "
                                         r"224 target ids"):
        compose_trees(parse_strategy("routed:confidence"), [narrow, wide], list(drafters), 12)
    with pytest.raises(ValueError, match="cannot merge with a budget drafters 'narrow' and 'wide'"):
        compose_trees(parse_strategy("merged:budget"), [narrow, wide], list(drafters), 12)
    union, _ = compose_trees(parse_strategy("merged:union"), [narrow, wide], list(drafters), 12)
    assert union.support is None and union.size > narrow.size


def test_common_support():
    target = make_tiny_target(0)
    ids = torch.arange(target.vocab_size)
    full, a, b = (DraftHead(target.config, draft_to_target=v) for v in (None, ids[:10], ids[5:20].flip(0)))
    assert common_support([full, DraftHead(target.config)]) is None
    assert common_support([a, DraftHead(target.config, draft_to_target=ids[:10].flip(0))]) is None
    assert torch.equal(common_support([a, b]), ids[:20])
    assert torch.equal(common_support([a, full]), ids)
    state = DrafterState(b)
    with pytest.raises(ValueError, match="misses 5 of the drafter's 15 draft ids"):
        state.support_rows(target, ids[:15])


@pytest.fixture(scope="module")
def deep():
    """A contextual target deep enough for EAGLE-3 drafters (8 layers: they read hidden states 2, 4, 5)."""
    return peaky_tiny_target(5, layers=8)


def eagle3_pool(target, name: str) -> dict:
    """EAGLE-3 drafters for ``name``: two for averaged, else an EAGLE-3 head on a reduced vocabulary beside a
    full-vocabulary one and an EAGLE-2 head (single takes the first)."""
    if name == "averaged":
        return {"a": sharp_eagle3(target, 1), "b": sharp_eagle3(target, 2)}
    return {"e3": sharp_eagle3(target, 1, vocab=torch.arange(2, 200)), "e2": sharp_drafter(target, 2),
            "e3b": sharp_eagle3(target, 3)}


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("name", ALL)
def test_eagle3_drafters_keep_greedy_output_equal_to_vanilla(deep, name, adaptive):
    """Every strategy with EAGLE-3 heads, alone, averaged, routed or merged with an EAGLE-2 head: greedy output
    is vanilla's; a composed strategy asks the target for the union of its drafters' layers."""
    tree = TREE.model_copy(update={"adaptive": adaptive})
    for seed in (1, 2):
        prompt = random_prompt(deep, 8, seed)
        vanilla = generate(deep, prompt, max_new_tokens=32)
        strategy = build_strategy(name, eagle3_pool(deep, name), tree, probe_steps=1, recheck_every=2)
        spec = generate(deep, prompt, strategy, max_new_tokens=32)
        assert spec.token_ids == vanilla.token_ids
        assert sum(s.appended for s in spec.steps) + 1 == len(spec.token_ids)
    expected = (2, 4, 5) if name in ("single", "averaged") else (2, 4, 5, 8)
    assert tuple(strategy.feature_layers) == expected


def test_merged_eagle2_and_eagle3_trees_are_each_drafters_own(deep):
    """In a merged strategy each drafter drafts from its own layers: its tree equals the one it drafts alone
    (the same nodes; scores differ only by the merged strategy's common support)."""
    pool = eagle3_pool(deep, "merged:union")
    prompt = random_prompt(deep, 9, 4)
    merged = spy(SpyMerged, pool)
    generate(deep, prompt, merged, max_new_tokens=6, eos_token_ids=frozenset())
    first = merged.log[0]
    for i, drafter in enumerate(pool.values()):
        alone = SingleStrategy(drafter, TREE)
        alone.name = "single"
        solo: list = []
        original = alone.propose
        alone.propose = lambda state, original=original, solo=solo: solo.append(original(state)) or solo[-1]
        generate(deep, prompt, alone, max_new_tokens=2, eos_token_ids=frozenset())
        assert torch.equal(first["drafted"][i].tokens, solo[0].tokens)
        assert torch.equal(first["drafted"][i].parent, solo[0].parent)


def test_averaging_across_architectures_is_refused_naming_both(deep):
    with pytest.raises(ValueError, match=r"cannot average drafter 0 \(TapsEagle3Head, eagle3.*with drafter 1 "
                                         r"\(TapsDraftHead, eagle2"):
        build_strategy("averaged", [sharp_eagle3(deep, 1), sharp_drafter(deep, 2)], TREE)
