"""DraftTree construction, EAGLE-2 expansion/rerank against a per-node reference, tree invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from taps_ray.config import TreeConfig
from taps_ray.spec.tree import DrafterState, build_tree, draft_tree, merge_trees, repeated_siblings, rerank
from tests.spec.spec_helpers import peaky_tiny_target, random_prompt, sharp_drafter, sharp_eagle3

TARGET = peaky_tiny_target(0)
DRAFTERS = [sharp_drafter(TARGET, seed) for seed in range(3)]


def prompt_pairs(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter input pairs of a random sequence of ``length + 1`` tokens: tokens [length] (token_{i+1},
    the last being the root) and the target's features [length, H] (f_i)."""
    seq = random_prompt(TARGET, length + 1, seed)
    return seq[1:], TARGET.hidden_states(seq[None, :-1])[0]


def python_ancestors(parent: list[int], i: int) -> set[int]:
    out = {i}
    while parent[i] >= 0:
        i = parent[i]
        out.add(i)
    return out


def node_paths(tree) -> dict[tuple[int, ...], float]:
    """Token path (root excluded) -> score for every non-root node."""
    parent, tokens = tree.parent.tolist(), tree.tokens.tolist()
    out = {}
    for i in range(1, tree.size):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parent[j]
        out[tuple(reversed(path))] = float(tree.score[i])
    return out


def reference_tree(drafter, tokens, features, cfg: TreeConfig, target=TARGET) -> dict[tuple[int, ...], float]:
    """EAGLE-2 one node at a time: every expanded node's drafter feature recomputed by a causal pass over
    the whole sequence (no cache, no tree mask); rerank by sorting Python lists. ``features`` [n, H] are the
    drafter's inputs (fused target features)."""
    weight = target.lm_head.weight

    def last_feature(toks: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(toks.numel())[None]
        return drafter(target.embed_tokens(toks)[None], feats[None], positions)[0, -1]

    def top(feature: torch.Tensor):
        logp = torch.log_softmax(drafter.logits(feature[None], weight)[0], -1)
        values, indices = logp.topk(cfg.top_k)
        return list(zip(values.tolist(), indices.tolist()))

    with torch.inference_mode():
        root_feature = last_feature(tokens, features)
        nodes = [{"path": (tok,), "score": lp, "pairs": [(tok, root_feature)]} for lp, tok in top(root_feature)]
        frontier = list(nodes)
        for _ in range(cfg.depth):
            children = []
            for node in frontier:
                toks = torch.cat([tokens, torch.tensor([t for t, _ in node["pairs"]])])
                feats = torch.cat([features, torch.stack([f for _, f in node["pairs"]])])
                feature = last_feature(toks, feats)
                for lp, tok in top(feature):
                    children.append({"path": node["path"] + (tok,), "score": node["score"] + lp,
                                     "pairs": node["pairs"] + [(tok, feature)]})
            nodes += children
            frontier = sorted(children, key=lambda n: -n["score"])[:cfg.top_k]
        best = sorted(nodes, key=lambda n: -n["score"])[:cfg.total_tokens - 1]
    return {n["path"]: n["score"] for n in best}


@pytest.mark.parametrize("cfg", [TreeConfig(depth=2, top_k=3, total_tokens=10),
                                 TreeConfig(depth=3, top_k=4, total_tokens=30),
                                 TreeConfig(depth=0, top_k=5, total_tokens=4),
                                 TreeConfig(depth=1, top_k=1, total_tokens=8)])
def test_draft_tree_equals_per_node_reference(cfg):
    tokens, features = prompt_pairs(9, seed=1)
    drafter = DRAFTERS[0]
    state = DrafterState(drafter)
    state.add(tokens, features)
    tree = draft_tree(drafter, TARGET, state, cfg)
    expected = reference_tree(drafter, tokens, features, cfg)
    got = node_paths(tree)
    assert set(got) == set(expected)
    for path, score in expected.items():
        assert got[path] == pytest.approx(score, rel=1e-5, abs=1e-4)


DEEP = peaky_tiny_target(4, layers=8)


@pytest.mark.parametrize("cfg", [TreeConfig(depth=2, top_k=3, total_tokens=10),
                                 TreeConfig(depth=3, top_k=4, total_tokens=30)])
def test_eagle3_tree_equals_per_node_reference_on_fused_target_layers(cfg):
    """An EAGLE-3 drafter fuses the target's three layers at the committed pairs and feeds its own pre-norm
    outputs back at deeper levels; scores are of its final-normed outputs."""
    drafter = sharp_eagle3(DEEP, 1)
    seq = random_prompt(DEEP, 10, 3)
    tokens, features = seq[1:], DEEP.hidden_states(seq[None, :-1], layers=drafter.feature_layers)[0]
    assert features.shape == (9, 3 * DEEP.hidden_size)
    state = DrafterState(drafter, layers=drafter.feature_layers)
    state.add(tokens, features)
    got = node_paths(draft_tree(drafter, DEEP, state, cfg))
    with torch.inference_mode():
        expected = reference_tree(drafter, tokens, drafter.fuse(features), cfg, DEEP)
    assert set(got) == set(expected)
    for path, score in expected.items():
        assert got[path] == pytest.approx(score, rel=1e-5, abs=1e-4)


def test_each_drafter_state_reads_its_own_layers_of_a_union():
    """Features laid out as a strategy's union of layers: each state keeps its drafter's columns, so the trees
    equal those drafted from features of exactly the drafter's layers; a layout missing a layer is refused."""
    eagle3, eagle2 = sharp_eagle3(DEEP, 2), sharp_drafter(DEEP, 3)
    union = (8, 2, 4, 5)
    seq = random_prompt(DEEP, 9, 5)
    tokens = seq[1:]
    features = DEEP.hidden_states(seq[None, :-1], layers=union)[0]
    cfg = TreeConfig(depth=2, top_k=3, total_tokens=10)
    for drafter, own in ((eagle3, DEEP.hidden_states(seq[None, :-1], layers=eagle3.feature_layers)[0]),
                         (eagle2, DEEP.hidden_states(seq[None, :-1])[0])):
        shared, alone = DrafterState(drafter, layers=union), DrafterState(drafter, layers=drafter.feature_layers)
        shared.add(tokens, features)
        alone.add(tokens, own)
        a, b = draft_tree(drafter, DEEP, shared, cfg), draft_tree(drafter, DEEP, alone, cfg)
        assert torch.equal(a.tokens, b.tokens)  # the columns: another layer's features would draft otherwise
        # the same values in other buffers: oneDNN's float32 product may round the last bit otherwise (seen on an
        # AMX Xeon), so the scores agree to float32 rounding, as in the per-node reference test above
        torch.testing.assert_close(a.score, b.score, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"target features hold hidden states \[8\]; a drafter needs \[2, 4, 5\] "
                                         r"\(missing \[2, 4, 5\]\)"):
        DrafterState(eagle3)


def test_incremental_drafter_cache_equals_one_pass():
    """Pairs fed over several steps (with expansion KV cropped in between) draft the same tree as all
    pairs fed at once: the cache keeps exactly the committed pairs."""
    tokens, features = prompt_pairs(14, seed=2)
    cfg = TreeConfig(depth=3, top_k=3, total_tokens=16)
    drafter = DRAFTERS[1]
    stepwise = DrafterState(drafter)
    for lo, hi in [(0, 6), (6, 7), (7, 11), (11, 14)]:
        stepwise.add(tokens[lo:hi], features[lo:hi])
        tree = draft_tree(drafter, TARGET, stepwise, cfg)
        assert stepwise.cache.get_seq_length() == stepwise.committed == tree.prefix_len == hi
        assert int(tree.tokens[0]) == int(tokens[hi - 1])
    at_once = DrafterState(drafter)
    at_once.add(tokens, features)
    reference = draft_tree(drafter, TARGET, at_once, cfg)
    assert torch.equal(tree.tokens, reference.tokens) and torch.equal(tree.parent, reference.parent)
    torch.testing.assert_close(tree.score, reference.score, atol=1e-4, rtol=0)


def test_draft_tree_without_new_pairs_is_an_error():
    state = DrafterState(DRAFTERS[0])
    with pytest.raises(RuntimeError, match="no new pairs"):
        draft_tree(DRAFTERS[0], TARGET, state, TreeConfig())


def check_tree(tree, prefix_len: int) -> None:
    """Structural invariants every DraftTree satisfies."""
    n = tree.size
    parent = tree.parent.tolist()
    assert parent[0] == -1 and tree.depth[0] == 0 and tree.score[0] == 0
    assert all(0 <= parent[i] < i for i in range(1, n)), "parents precede children"
    expected_mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        expected_mask[i, list(python_ancestors(parent, i))] = True
    assert torch.equal(tree.mask, expected_mask), "mask == ancestor-or-self relation"
    assert torch.equal(tree.depth[1:], tree.depth[tree.parent[1:]] + 1)
    assert bool((tree.score[1:] <= tree.score[tree.parent[1:]]).all()), "scores never increase along a path"
    assert torch.equal(tree.positions, prefix_len + tree.depth)
    siblings = {(p, t) for p, t in zip(parent[1:], tree.tokens[1:].tolist())}
    assert len(siblings) == n - 1, "siblings carry distinct tokens"
    paths = tree.paths
    has_child = set(parent[1:])
    leaves = [i for i in range(n) if i not in has_child]
    assert sorted(paths.max(1).values.tolist()) == leaves
    for row in paths.tolist():
        nodes = [i for i in row if i >= 0]
        assert nodes[0] == 0 and all(parent[b] == a for a, b in zip(nodes, nodes[1:]))


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(0, 3), top_k=st.integers(1, 5), total=st.integers(2, 60), seed=st.integers(0, 2),
       length=st.integers(1, 12))
def test_draft_tree_invariants(depth, top_k, total, seed, length):
    tokens, features = prompt_pairs(length, seed)
    cfg = TreeConfig(depth=depth, top_k=top_k, total_tokens=total)
    state = DrafterState(DRAFTERS[seed])
    state.add(tokens, features)
    tree = draft_tree(DRAFTERS[seed], TARGET, state, cfg)
    check_tree(tree, prefix_len=length)
    assert tree.size == min(total, 1 + top_k + depth * top_k * top_k)
    assert int(tree.depth.max()) <= depth + 1
    assert int(tree.tokens[0]) == int(tokens[-1])
    assert state.cache.get_seq_length() == length, "expansion KV is cropped"
    assert bool(torch.isfinite(tree.entropy).all() and (tree.entropy >= 0).all()) and tree.entropy[0] == 0


@st.composite
def random_trees(draw, max_nodes: int = 16, vocab: int = 4):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [7] + [draw(st.integers(0, vocab - 1)) for _ in range(1, n)]
    return tokens, parents


def dedupe(tokens, parents):
    """Drop nodes whose (parent, token) repeats an earlier sibling, with their subtrees (trie form)."""
    keep, remap, seen = [], {}, set()
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        if i == 0:
            keep.append(i)
            remap[i] = 0
            continue
        if par not in remap or (remap[par], tok) in seen:
            continue
        seen.add((remap[par], tok))
        remap[i] = len(keep)
        keep.append(i)
    return [tokens[i] for i in keep], [-1] + [remap[parents[i]] for i in keep[1:]]


@settings(max_examples=60, deadline=None)
@given(trees=st.lists(random_trees(), min_size=1, max_size=3), budget=st.integers(1, 20))
def test_build_merge_select_invariants(trees, budget):
    built = []
    for tokens, parents in trees:
        tokens, parents = dedupe(tokens, parents)
        tree = build_tree(tokens, parents, score=None, prefix_len=5)
        check_tree(tree, prefix_len=5)
        built.append(tree)
    merged = merge_trees(built)
    check_tree(merged, prefix_len=5)
    union = set().union(*(node_paths(t) for t in built))
    assert set(node_paths(merged)) == union, "the merge is the trie union of the paths"
    sources = merged.meta["sources"]
    for k, tree in enumerate(built):
        mine = set(node_paths(tree))
        for i, path in enumerate(node_paths(merged), start=1):
            assert bool(sources[i, k]) == (path in mine)
    top = merged.top(budget)
    check_tree(top, prefix_len=5)
    assert top.size == min(budget, merged.size)
    kept = sorted(merged.score[1:].tolist(), reverse=True)[:top.size - 1]
    assert sorted(top.score[1:].tolist(), reverse=True) == kept


def test_build_tree_rejects_bad_parents():
    with pytest.raises(ValueError, match="root"):
        build_tree([1, 2], [0, 0])
    with pytest.raises(ValueError, match="node 2 has parent 3"):
        build_tree([1, 2, 3, 4], [-1, 0, 3, 0])
    with pytest.raises(ValueError, match="same length"):
        build_tree([1, 2], [-1])
    with pytest.raises(ValueError, match="share the prefix"):
        merge_trees([build_tree([1, 2], [-1, 0]), build_tree([2, 2], [-1, 0])])


def test_rerank_keeps_parents_on_ties():
    # candidates listed parents first; node 1 is the child of node 0 with the same score
    score = torch.tensor([-1.0, -1.0, -0.5, -3.0])
    assert rerank(score, 2).tolist() == [0, 2]
    assert rerank(score, 3).tolist() == [0, 1, 2]


def test_paths_of_hand_built_tree():
    tree = build_tree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1], prefix_len=3)
    assert tree.paths.tolist() == [[0, 2, -1], [0, 1, 3], [0, 1, 4]]
    assert tree.positions.tolist() == [3, 4, 4, 5, 5]
    sub = tree.select(torch.tensor([0, 1, 4]))
    assert sub.tokens.tolist() == [9, 1, 4] and sub.parent.tolist() == [-1, 0, 1]


@pytest.mark.parametrize("tokens, parents, message", [
    ([9, 4, 4], [-1, 0, 0], "nodes 1 and 2 \\(children of node 0\\) both carry token 4"),
    ([9, 1, 2, 3, 5, 3], [-1, 0, 0, 1, 2, 1], "nodes 3 and 5 \\(children of node 1\\) both carry token 3"),
])
def test_build_tree_refuses_repeated_sibling_tokens(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        build_tree(tokens, parents)
    cousins = build_tree([9, 1, 2, 3, 3], [-1, 0, 0, 1, 2])  # equal tokens under different parents are fine
    assert cousins.size == 5
    assert not repeated_siblings(cousins.tokens, cousins.parent)
    assert repeated_siblings(torch.tensor(tokens), torch.tensor(parents))
