import pytest
import torch

from taps_ray.config import TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.spec.decoder import generate
from taps_ray.spec.lookup import LOOKUP_LOGP, graft_chain, graft_lookup, lookup_continuation
from taps_ray.spec.protocol import SingleStrategy
from taps_ray.spec.tree import ancestor_mask, build_tree, check_distinct_siblings
from tests.spec.spec_helpers import bigram_target, random_prompt


def t(*values):
    return torch.tensor(values, dtype=torch.long)


def test_continuation_takes_the_latest_longest_match():
    assert lookup_continuation(t(5, 6, 7, 8, 9, 5, 6), 3, 2, 4).tolist() == [7, 8, 9, 5]
    assert lookup_continuation(t(1, 2, 3, 1, 2, 4, 1, 2), 3, 2, 8).tolist() == [4, 1, 2]
    assert lookup_continuation(t(9, 1, 2, 3, 7, 2, 3, 5, 1, 2, 3), 3, 1, 2).tolist() == [7, 2]
    assert lookup_continuation(t(1, 2, 3, 4), 3, 2, 4).numel() == 0
    assert lookup_continuation(t(1, 2, 3, 4, 3), 3, 2, 4).numel() == 0
    assert lookup_continuation(t(1, 2, 3, 4, 3), 3, 1, 4).tolist() == [4, 3]
    assert lookup_continuation(t(7), 3, 1, 4).numel() == 0


def test_config_refuses_a_min_ngram_above_the_max():
    with pytest.raises(ValueError, match="lookup_min_ngram"):
        TreeConfig(lookup_ngram=2, lookup_min_ngram=3)


def _tree():
    # root 10 -> 11 -> 12, root -> 13
    return build_tree([10, 11, 12, 13], [-1, 0, 1, 0], [0.0, -0.1, -0.3, -0.5], prefix_len=5)


def test_graft_shares_the_existing_prefix_and_appends_the_rest():
    tree = _tree()
    tree.support = t(10, 11, 12, 13, 20, 21)
    grafted = graft_chain(tree, t(11, 12, 20, 21))
    assert grafted.support is tree.support
    assert grafted.tokens.tolist() == [10, 11, 12, 13, 20, 21]
    assert grafted.parent.tolist() == [-1, 0, 1, 0, 2, 4]
    assert grafted.depth.tolist() == [0, 1, 2, 1, 3, 4]
    assert torch.equal(grafted.mask, ancestor_mask(grafted.parent))
    assert torch.allclose(grafted.score[4:], torch.tensor([-0.3 + LOOKUP_LOGP, -0.3 + 2 * LOOKUP_LOGP]))
    assert grafted.meta["lookup_nodes"] == 2 and grafted.prefix_len == 5
    check_distinct_siblings(grafted.tokens, grafted.parent)
    assert (grafted.score[1:] <= grafted.score[grafted.parent[1:]]).all()


def test_graft_from_the_root_and_when_nothing_is_new():
    tree = _tree()
    grafted = graft_chain(tree, t(14, 15))
    assert grafted.parent.tolist() == [-1, 0, 1, 0, 0, 4] and grafted.depth.tolist()[4:] == [1, 2]
    assert torch.equal(grafted.mask, ancestor_mask(grafted.parent))
    assert graft_chain(tree, t(11, 12)) is tree
    assert graft_chain(tree, t(11)) is tree
    assert graft_chain(tree, t()) is tree


def test_graft_lookup_turns_off_at_zero_and_stands_alone_without_a_tree():
    tree = _tree()
    context = t(7, 8, 9, 4, 7, 8)
    assert TreeConfig().lookup_tokens > 0, "the CPU default grafts lookup chains"
    off = TreeConfig(lookup_tokens=0)
    assert graft_lookup(tree, context, off) is tree
    assert graft_lookup(None, context, off) is None
    assert graft_lookup(None, t(1, 2, 3, 4), TreeConfig(lookup_tokens=4)) is None
    alone = graft_lookup(None, context, TreeConfig(lookup_tokens=2))
    assert alone.tokens.tolist() == [8, 9, 4] and alone.parent.tolist() == [-1, 0, 1]
    assert alone.prefix_len == context.numel() - 1 and alone.meta["lookup_nodes"] == 2


@pytest.fixture(scope="module")
def cycling_target():
    return bigram_target(3)


def test_lookup_keeps_greedy_output_and_pays_where_the_text_repeats(cycling_target):
    """A bigram target's greedy text falls into a cycle: copies of it are exactly what lookup proposes, and
    the output must still be the target's own."""
    prompt = random_prompt(cycling_target, 12, seed=2)
    plain = generate(cycling_target, prompt, None, None, 80)
    drafter = DraftHead(cycling_target.config, seed=1).eval()
    base = generate(cycling_target, prompt, SingleStrategy(drafter, TreeConfig(lookup_tokens=0)), None, 80)
    looked = generate(cycling_target, prompt, SingleStrategy(drafter, TreeConfig(lookup_tokens=6)), None, 80)
    assert base.token_ids == plain.token_ids and looked.token_ids == plain.token_ids
    assert len(set(plain.token_ids[-40:])) < 40, "the bigram target should repeat itself"
    assert max(step.accepted for step in looked.steps) == 6 > TreeConfig().depth + 1
    assert len(looked.steps) < 0.7 * len(base.steps)
