"""spec/cost.py: the measured cost model, its cache, and the per-step tree size it picks (lossless)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from taps_ray.config import TreeConfig
from taps_ray.spec import cost as cost_module
from taps_ray.spec import machine
from taps_ray.spec.batch_load import BatchLoad, Others
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.cost import PROBE_SHARE, CostModel, TreeBudget, cost_model
from taps_ray.spec.decoder import generate
from taps_ray.spec.machine import fingerprint
from taps_ray.spec.tree import build_tree
from tests.spec.spec_helpers import bigram_target, oracle_drafter, random_prompt, sharp_drafter

TREE = TreeConfig(depth=3, top_k=4, total_tokens=12, lookup_tokens=0)
ALL = ["single", "averaged", "routed:confidence", "routed:entropy", "merged:union", "merged:budget"]


def _model(verify_s: list[float]) -> CostModel:
    return CostModel(nodes=[1, 2, 4, 8, 16], verify_s=verify_s, prefix=8)


def test_verify_interpolates_between_and_beyond_the_grid():
    model = _model([1.0, 1.5, 2.0, 4.0, 8.0])
    assert float(model.verify(3)) == pytest.approx(1.75)
    assert float(model.verify(32)) == pytest.approx(16.0)
    assert model.relative() == {1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0, 16: 8.0}
    assert "plain step 1000.0 ms" in model.summary()


def test_verify_one_is_verify_of_one_count_to_the_bit():
    model = _model([0.0123, 0.0151, 0.0197, 0.0402, 0.0817])
    counts = [0, 0.5, 1, 1.3, 2, 3, 4, 5.75, 8, 11, 16, 17, 40, 64.5, 1000]
    assert [model.verify_one(n) for n in counts] == model.verify(torch.tensor(counts, dtype=torch.float64)).tolist()
    assert model.plain_s == model.verify_one(1) == 0.0123


def _tree(scores: list[float]):
    n = len(scores) + 1
    return build_tree(list(range(2, 2 + n)), [-1] + [0] * (n - 1), score=[0.0] + scores)


def test_choose_keeps_nodes_that_pay_and_drops_those_that_do_not():
    free = TreeBudget(_model([1.0, 1.0, 1.0, 1.0, 1.0]))
    confident = _tree([-0.1, -0.2, -0.3, -3.0, -4.0])
    assert free.choose(confident, draft_s=0.0).size == 6
    steep = TreeBudget(_model([1.0, 1.3, 2.0, 4.0, 8.0]))
    assert steep.choose(_tree([-5.0, -6.0, -7.0]), draft_s=0.0) is None
    assert steep.choose(_tree([-0.01, -5.0, -6.0]), draft_s=0.0).size == 2
    assert list(steep.chosen) == [1, 2]


def test_rates_follow_observed_acceptance_per_score_bin():
    budget = TreeBudget(_model([1.0, 1.0, 1.0, 1.0, 1.0]))
    prior = budget.rates().clone()
    assert bool((prior[1:] < prior[:-1]).all()), "before any observation a bin's rate is exp(its score)"
    tree = _tree([-0.1, -0.1, -5.0])
    for _ in range(30):
        budget.observe(tree, torch.tensor([0, 3]), draft_s=1.0)
    rates = budget.rates()
    assert rates[0] < 0.15 and rates[-2] > 0.9, "bin (-0.25, 0] never accepted, bin (-6, -4] always"
    assert torch.equal(budget.rates("lookup"), prior)
    assert budget.chance(tree).tolist() == pytest.approx(rates[[0, 0, 7]].tolist())


def test_lookup_nodes_are_calibrated_apart_and_kept_when_they_are_accepted():
    from taps_ray.spec.lookup import graft_chain

    budget = TreeBudget(_model([1.0, 1.6, 2.5, 4.0, 8.0]))
    tree = graft_chain(_tree([-3.0, -3.5]), torch.tensor([7, 8, 9]))
    assert tree.meta["lookup_nodes"] == 3
    assert budget.choose(tree, draft_s=0.0) is None, "uncalibrated, a copied chain looks unlikely"
    lookup_path = torch.tensor([0, tree.size - 3, tree.size - 2, tree.size - 1])
    for _ in range(20):
        budget.observe(tree, lookup_path, draft_s=1.0)
    assert bool((budget.rates("lookup")[[2, 3, 5]] > 0.8).all()) and bool((budget.rates()[5:7] < 0.05).all())
    kept = budget.choose(tree, draft_s=0.0)
    assert kept is not None and kept.tokens[1:].tolist() == [7, 8, 9] and kept.meta["lookup_nodes"] == 3


def test_every_few_drafted_steps_verify_twice_the_nodes_that_pay():
    budget = TreeBudget(_model([1.0, 2.0, 4.0, 8.0, 16.0]), explore_every=3)
    small = _tree([-5.0, -6.0])
    assert [budget.choose(small, 0.0) is small for _ in range(6)] == [False, False, True, False, False, True]
    steep = TreeBudget(_model([1.0, 1.02, 1.04, 4.0, 8.0]), explore_every=2)
    large = _tree([-0.01, -0.02] + [-5.0] * 13)
    sizes = [getattr(steep.choose(large, 0.0), "size", 1) for _ in range(4)]
    assert sizes == [3, 6, 3, 6], "root + 2 nodes pay; an exploring step verifies 6 (not all 16)"


def test_a_requests_first_drafted_step_does_not_set_the_drafting_seconds():
    """It also runs the prompt through the drafter (and a drafter's first use sets it up): a per-request cost."""
    budget = TreeBudget(_model([0.04, 0.041, 0.043, 0.05, 0.07]), probe_every=100)
    tree, path = _tree([-0.1] * 3), torch.tensor([0, 1, 2])
    budget.observe(tree, path, draft_s=None)
    assert budget.pays(), "no drafting seconds seen yet: drafting is given its chance"
    budget.observe(tree, path, draft_s=0.01)
    budget.observe(tree, path, draft_s=None)
    assert budget.pays(), "3 tokens for 0.01 s of drafting and 4 nodes beat a plain step"
    budget.observe(tree, path, draft_s=5.0)
    assert not budget.pays()


def _virtual_clock(monkeypatch, target) -> list[float]:
    """Run the decoder on a virtual clock that only ``target``'s forwards advance (1 s each); returns the
    clock (``clock[0]``), which a test's strategy may advance for its drafting."""
    from types import SimpleNamespace

    from taps_ray.spec import decoder as decoder_module

    clock = [0.0]
    monkeypatch.setattr(decoder_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    forward = target.forward

    def timed_forward(*args, **kwargs):
        clock[0] += 1.0
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", timed_forward)
    return clock


def test_the_decoder_leaves_out_each_requests_first_drafting(monkeypatch):
    """A strategy whose first proposal of a request is slow (the prompt's pairs) keeps drafting.

    The decoder's clock is a virtual one (each verification forward 1 s, a proposal 1 ms, a request's first
    proposal 50 s), so what the budget sees does not depend on the machine's load."""
    target = bigram_target(0)
    drafter = oracle_drafter(target)
    clock = _virtual_clock(monkeypatch, target)
    budget = TreeBudget(_model([1.0, 1.0, 1.05, 1.1, 1.2]), probe_every=100)

    class SlowStart:
        def __init__(self):
            self.inner, self.first = build_strategy("single", {"d": drafter}, TREE), True
            self.name = "single"

        def start(self, *args):
            self.first = True
            self.inner.start(*args)

        def propose(self, state):
            clock[0] += 50.0 if self.first else 0.001
            self.first = False
            return self.inner.propose(state)

        def advance(self, *args):
            self.inner.advance(*args)

    for seed in range(2):
        spec = generate(target, random_prompt(target, 6, seed), SlowStart(), max_new_tokens=20, budget=budget)
        assert all(s.tree_size > 1 for s in spec.steps[:-1]), [s.tree_size for s in spec.steps]
    assert budget.pays()


def _chain(depth: int, width: int = 1):
    """A tree of ``width`` chains of ``depth`` nodes under the root (node depth d of chain c: 1 + c * depth + d - 1)."""
    parent, score = [-1], [0.0]
    for _ in range(width):
        for d in range(depth):
            parent.append(0 if d == 0 else len(parent) - 1)
            score.append(-0.1 * (d + 1))
    return build_tree(list(range(2, 2 + len(parent))), parent, score=score)


def _deep_and_shallow(deep_accepted: bool, draft_s_per_level: float = 0.01):
    """A budget that saw DEPTH_EVIDENCE full depth-3 steps (3 chains) accepting 3 nodes or 1, and timed
    depth-3 drafting at 4 drafter passes of ``draft_s_per_level``."""
    budget = TreeBudget(_model([0.04, 0.045, 0.06, 0.09, 0.15]), probe_every=100, explore_every=0)
    tree = _chain(3, width=3)
    path = torch.tensor([0, 1, 2, 3] if deep_accepted else [0, 1])
    for _ in range(TreeBudget.DEPTH_EVIDENCE):
        budget.observe(tree, path, draft_s=4 * draft_s_per_level, verify_s=0.06)
    return budget


def test_the_budget_drafts_only_as_deep_as_pays():
    """Depth-2 and -3 nodes never accepted: in hindsight a depth-1 tree appends as much for fewer nodes and one
    drafter pass of four, so the budget asks for depth 1; when the deep nodes are accepted it keeps the tree's."""
    shallow = _deep_and_shallow(deep_accepted=False)
    assert shallow.depth() == 1
    stats = shallow._depths
    assert [round(stats[d].gain, 3) for d in (1, 2, 3)] == [2.0, 2.0, 2.0]
    assert [round(stats[d].nodes, 3) for d in (1, 2, 3)] == [4.0, 7.0, 10.0]
    assert shallow._draft_s(1) == pytest.approx(0.02), "scaled by drafter passes from depth 3's timing"
    assert _deep_and_shallow(deep_accepted=True).depth() is None


def test_the_depth_stays_the_strategys_until_each_depth_has_evidence_and_on_exploring_steps():
    budget = TreeBudget(_model([0.04, 0.04, 0.04, 0.04, 0.04]), probe_every=100, explore_every=3)
    tree, path = _chain(3, width=3), torch.tensor([0, 1])
    decisions = []
    for _ in range(9):
        decisions.append(budget.depth())
        kept = budget.choose(tree if decisions[-1] is None else tree.select(torch.arange(4)), 0.0)
        budget.observe(kept, path, draft_s=0.04 if decisions[-1] is None else 0.02, verify_s=0.06)
    assert decisions[:TreeBudget.DEPTH_EVIDENCE + 1].count(None) >= TreeBudget.DEPTH_EVIDENCE
    assert all(d in (None, 1) for d in decisions) and 1 in decisions
    assert [i for i, d in enumerate(decisions) if d is None and i >= 6] == [8], "every 3rd drafted step explores"


def test_nodes_on_the_lookup_chain_count_at_every_depth():
    """A shallower tree carries the prompt-lookup chain too: a path accepted along it appends as much."""
    from taps_ray.spec.lookup import graft_chain

    budget = TreeBudget(_model([0.04, 0.045, 0.06, 0.09, 0.15]), probe_every=100)
    drafted = _chain(2)  # tokens 3, 4 at depths 1, 2
    tree = graft_chain(drafted, torch.tensor([3, 4, 9, 10]))
    assert tree.meta["lookup_nodes"] == 2
    budget.observe(tree, torch.tensor([0, 1, 2, 3, 4]), draft_s=0.02)
    assert budget._depths[1].gain == 5.0 and budget._depths[1].nodes == 5.0
    other = TreeBudget(_model([0.04, 0.045, 0.06, 0.09, 0.15]))
    other.observe(drafted, torch.tensor([0, 1, 2]), draft_s=0.02)
    assert other._depths[1].gain == 2.0 and other._depths[2].gain == 3.0


def test_a_tree_cut_to_its_lookup_chain_is_budgeted_without_drafted_nodes():
    """A batch's node limit cuts a tree to its best-scored nodes (``DraftTree.top``); when only the chain is
    left the tree has no drafted node, and the budget learns from it as from a lookup-only step."""
    from taps_ray.spec.lookup import graft_chain

    tree = graft_chain(_tree([-5.0, -6.0]), torch.tensor([7, 8, 9]))
    tree.score[-3:] = torch.tensor([-0.1, -0.2, -0.3])
    cut = tree.top(3)
    assert cut.tokens.tolist() == [2, 7, 8] and cut.meta["lookup_nodes"] == 2
    budget = TreeBudget(_model([1.0, 1.0, 1.0, 1.0, 1.0]))
    kept = budget.choose(cut, 0.0)
    assert kept is not None and kept.meta["lookup_nodes"] == kept.size - 1
    budget.observe(kept, torch.tensor([0, 1, 2]), draft_s=0.01)
    assert not budget._depths and budget.depth() is None and budget.rates("lookup")[0] > budget.rates()[0]


def test_strategies_draft_no_deeper_than_the_step_asks():
    from taps_ray.spec.protocol import DecodeState

    target = bigram_target(0)
    drafters = {"a": oracle_drafter(target), "b": sharp_drafter(target, 1)}
    prompt = random_prompt(target, 6, 0)
    for name in ALL:
        depths = {}
        for depth in (None, 1, 2):
            strategy = build_strategy(name, drafters, TREE)
            strategy.start(target, prompt[1:], torch.zeros(prompt.numel() - 1, target.hidden_size))
            state = DecodeState(prompt, prompt.numel() - 1, prompt.numel(), 0, depth=depth)
            depths[depth] = int(strategy.propose(state).depth.max())
        assert depths[1] == 1 and depths[2] == 2 and 2 < depths[None] <= TREE.depth + 1, (name, depths)


def test_a_new_request_probes_again_after_probe_every_steps():
    budget = TreeBudget(_model([1.0, 1.0, 1.0, 1.0, 1.0]), probe_every=3, probe_share=math.inf)
    budget.observe(_tree([-0.1]), torch.tensor([0]), draft_s=10.0)
    assert [i for i in range(50) if budget.should_draft()] == [2, 8, 20, 44]
    budget.bind(object())
    assert [i for i in range(9) if budget.should_draft()] == [2, 8]


def test_a_new_request_beside_peers_keeps_the_probes_backing_off():
    """Under load every arriving request would otherwise restart the probes of the budget its peers share; the
    peers' count, seen each step, already says when the load lets drafting pay again."""
    budget = TreeBudget(_model([1.0, 1.0, 1.0, 1.0, 1.0]), probe_every=3, probe_share=math.inf)
    budget.observe(_tree([-0.1]), torch.tensor([0]), draft_s=10.0)
    assert [i for i in range(50) if budget.should_draft()] == [2, 8, 20, 44]
    budget.bind(object())
    peers = Others(peers=1)
    assert not any(budget.should_draft(peers) for _ in range(9)), "the gap stays at 24 steps (48 calls of 2)"


def test_probes_that_lose_much_come_no_more_often_than_their_loss_allows():
    """A probe that took 11 plain steps' time for one token loses 10 of them: at least 10 / PROBE_SHARE plain
    steps pass before the next one, for a request alone and for a new one alike."""
    budget = TreeBudget(_model([1.0, 1.0, 1.0, 1.0, 1.0]), probe_every=3)
    budget.observe(_tree([-0.1]), torch.tensor([0]), draft_s=10.0)
    floor = 10 / PROBE_SHARE
    probes = [i for i in range(int(2.5 * floor)) if budget.should_draft()]
    assert len(probes) == 2 and probes[0] >= floor - 1 and probes[1] - probes[0] >= floor
    budget.bind(object())
    assert not any(budget.should_draft() for _ in range(int(floor) - 1))
    paying = TreeBudget(_model([1.0, 1.0, 1.0, 1.0, 1.0]), probe_every=3)
    paying.observe(_tree([-0.1]), torch.tensor([0, 1]), draft_s=0.1)
    assert all(paying.should_draft() for _ in range(20)), "drafting that pays is never held back"


def test_fresh_keeps_the_settings_and_the_cost_model_and_forgets_the_rest():
    model = _model([1.0, 1.0, 1.0, 1.0, 1.0])
    budget = TreeBudget(model, probe_every=5, explore_every=7)
    budget.observe(_tree([-0.1]), torch.tensor([0]), draft_s=10.0)
    budget.choose(_tree([-0.1, -0.2]), 0.0)
    fresh = budget.fresh()
    assert fresh.cost is model and (fresh.probe_every, fresh.explore_every) == (5, 7)
    assert not fresh.chosen and fresh.should_draft() and torch.equal(fresh.rates(), TreeBudget(model).rates())


def test_measure_takes_each_sizes_fastest_round_and_never_lets_a_larger_tree_cost_less(monkeypatch, peaky_target):
    """A burst of a neighbour during one size's rounds must not make a larger tree look cheaper."""
    import time as time_module

    from taps_ray.spec import verify

    calls = []
    real = verify.run_tree

    def bursty(target, tree, cache):
        calls.append(tree.size)
        out = real(target, tree, cache)
        if tree.size == 2:
            time_module.sleep(0.05)
        return out

    monkeypatch.setattr(verify, "run_tree", bursty)
    model = cost_module.measure(peaky_target, nodes=(1, 2, 4), repeats=2)
    assert calls == [1, 2, 4] * 3, "rounds over every size, the first a warm-up"
    assert model.verify_s[0] <= model.verify_s[1] <= model.verify_s[2]
    assert model.verify_s[2] >= 0.05, "4 nodes cost at least what the bursty 2 did"


def test_the_pause_compares_drafted_steps_with_plain_ones_at_the_runs_own_level():
    budget = TreeBudget(_model([0.01, 0.01, 0.01, 0.01, 0.01]), probe_every=100)
    budget.observe(_tree([-0.1]), torch.tensor([0, 1]), draft_s=1.0, verify_s=0.01)
    assert not budget.should_draft(), "2 tokens in 1.01 s against a plain step's 1 in 0.01 s"
    for _ in range(30):
        budget.observe(None, None, draft_s=0.0, verify_s=2.0)
    assert budget.scale > 100 and budget.should_draft(), "but verification takes 2 s on this machine now"


def test_in_a_batch_drafting_pays_only_against_the_batchs_plain_rate():
    """Alone, 3 tokens for 8 nodes and 10 ms of drafting beat a 40 ms plain step; beside 15 plain requests the
    same draft costs all 16 its drafting and extra rows, and a plain batch step is worth 16 tokens."""
    model = CostModel([1, 2, 4, 8, 16, 32], [0.040, 0.041, 0.043, 0.05, 0.07, 0.12], prefix=64)
    budget = TreeBudget(model, probe_every=100)
    budget.observe(_tree([-0.1] * 7), torch.tensor([0, 1, 2]), draft_s=0.010, verify_s=0.05)
    assert budget.pays() and budget.should_draft()
    assert not budget.pays((15, 15)) and not budget.should_draft((15, 15))


def test_drafting_pauses_while_it_does_not_pay_and_probes_again_less_and_less_often():
    budget = TreeBudget(_model([1.0, 1.0, 1.0, 1.0, 1.0]), probe_every=3, probe_share=math.inf)
    assert budget.should_draft()
    budget.observe(_tree([-0.1]), torch.tensor([0]), draft_s=10.0)
    probes = [i for i in range(100) if budget.should_draft()]
    assert probes == [2, 8, 20, 44, 68, 92], "gaps 3, 6, 12, 24, then 24 (8 x probe_every)"
    for _ in range(15):
        budget.observe(_tree([-0.1]), torch.tensor([0, 1]), draft_s=0.01)
    assert budget.should_draft(), "the probes saw drafting pay again"
    budget.observe(_tree([-0.1]), torch.tensor([0]), draft_s=10.0)
    for _ in range(15):
        budget.observe(_tree([-0.1]), torch.tensor([0]), draft_s=10.0)
    assert [i for i in range(10) if budget.should_draft()] == [2, 8], "paying again reset the gap"


def test_requests_sharing_a_budget_draft_only_when_drafting_for_all_of_them_pays():
    """Alone, 3 tokens for 8 nodes and 10 ms of drafting beat a 40 ms plain step; 16 requests of one budget
    drafting alike would append 48 tokens in 16 x 10 ms + a 128-row forward, against 16 in one 16-row forward."""
    model = CostModel([1, 2, 4, 8, 16, 32, 64, 128], [0.04, 0.04, 0.04, 0.045, 0.05, 0.07, 0.1, 0.15], prefix=64)
    budget = TreeBudget(model, probe_every=2, probe_share=math.inf)
    budget.observe(_tree([-0.1] * 7), torch.tensor([0, 1, 2]), draft_s=0.010, verify_s=0.045)
    assert budget.pays() and budget.pays(Others(peers=1))
    peers = Others(peers=15)
    assert not budget.pays(peers)
    assert [i for i in range(40) if budget.should_draft(peers)] == [31], "a probe every 2 steps of each of 16"
    load = BatchLoad()
    load.note(1, 8, 3, 0.02, group=7)
    load.note(2, 1, 1, 0.0, group=7)
    load.note(3, 9, 4, 0.03, group=None)
    assert load.others(1, group=7) == (9, 4, 0.03, 1)
    assert load.others(1) == (10, 5, 0.03, 0), "no group: every other request as it did"


def test_requests_starting_together_wait_for_one_measurement(tmp_path, monkeypatch, peaky_target):
    """A batch's requests bind their budgets at once on a machine without a cached model: one measures."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(cost_module, "cache_dir", lambda: tmp_path)
    peaky_target.__dict__.pop("_cost_model", None)
    calls = []
    real = cost_module.measure
    monkeypatch.setattr(cost_module, "measure", lambda target: calls.append(1) or real(target, nodes=(1, 2)))
    with ThreadPoolExecutor(8) as pool:
        models = list(pool.map(lambda _: TreeBudget().bind(peaky_target).cost, range(8)))
    assert len(calls) == 1 and all(m is models[0] for m in models)
    assert [p.name for p in tmp_path.iterdir()] == [cost_module.cost_path(models[0].key).name]
    peaky_target.__dict__.pop("_cost_model")


def test_cost_model_is_measured_once_cached_and_keyed_by_the_machine(tmp_path, monkeypatch, peaky_target):
    monkeypatch.setattr(cost_module, "cache_dir", lambda: tmp_path)
    peaky_target.__dict__.pop("_cost_model", None)
    calls = []
    real = cost_module.measure
    monkeypatch.setattr(cost_module, "measure", lambda target: calls.append(1) or real(target, nodes=(1, 2, 4)))
    first = cost_model(peaky_target)
    assert first.key == fingerprint(peaky_target) and len(first.verify_s) == 3 and all(s > 0 for s in first.verify_s)
    [stored] = list(tmp_path.glob("*.json"))
    assert json.loads(stored.read_text())["key"]["threads"] == torch.get_num_threads()
    peaky_target.__dict__.pop("_cost_model")
    assert cost_model(peaky_target).verify_s == first.verify_s and len(calls) == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert cost_model(peaky_target).key["threads"] == threads + 1 and len(calls) == 2
    finally:
        torch.set_num_threads(threads)


def test_a_change_to_the_engines_code_measures_the_cost_model_again(monkeypatch, peaky_target):
    key = fingerprint(peaky_target)
    assert key["engine_code"] == machine.engine_revision() and len(key["engine_code"]) == 12
    monkeypatch.setattr(machine, "engine_revision", lambda: "0" * 12)
    changed = fingerprint(peaky_target)
    assert changed["engine_code"] == "0" * 12
    assert cost_module.cost_path(changed) != cost_module.cost_path(key)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("steep", [False, True])
def test_greedy_output_equals_vanilla_with_a_budget(name, steep, monkeypatch):
    """On a virtual clock (verification 1 s, drafting free), so that the cheap budget's trees pay on any load."""
    target = bigram_target(0)
    _virtual_clock(monkeypatch, target)
    ids = torch.arange(target.vocab_size)
    drafters = ({"oracle": oracle_drafter(target), "n1": sharp_drafter(target, 1)} if name == "averaged" else
                {"even": oracle_drafter(target, ids[ids % 2 == 0]), "odd": oracle_drafter(target, ids[ids % 2 == 1])})
    model = _model([1.0, 2.0, 4.0, 8.0, 16.0] if steep else [1.0, 1.0, 1.05, 1.1, 1.2])
    prompt = random_prompt(target, 6, 3)
    vanilla = generate(target, prompt, max_new_tokens=40)
    budget = TreeBudget(model)
    spec = generate(target, prompt, build_strategy(name, drafters, TREE, probe_steps=1, recheck_every=2),
                    max_new_tokens=40, budget=budget)
    assert spec.token_ids == vanilla.token_ids
    assert budget.chosen and sum(s.appended for s in spec.steps) + 1 == len(spec.token_ids)
    if not steep:
        assert max(spec.accept_lengths) >= 2


def _cached_budget(tmp_path, monkeypatch, verify_s: list[float]) -> tuple[TreeBudget, CostModel]:
    """A budget bound to a cost model taken from a cache in ``tmp_path`` (as :func:`cost_model` gives it)."""
    monkeypatch.setattr(cost_module, "cache_dir", lambda: tmp_path)
    model = CostModel(nodes=[1, 2, 4, 8, 16], verify_s=verify_s, prefix=8, key={"hardware": "test"})
    cost_module.cost_path(model.key).write_text(json.dumps(model.to_dict()))
    monkeypatch.setattr(cost_module, "cost_model", lambda target: model)
    return TreeBudget().bind(object()), model


def test_a_cached_cost_model_measured_on_a_busy_machine_is_retired(tmp_path, monkeypatch, caplog):
    """Plain steps running 5x faster than the cached model says: after STALE_AFTER of them the file is removed
    (the next process measures again); the running budget keeps the model and its scale."""
    budget, model = _cached_budget(tmp_path, monkeypatch, [0.05, 0.06, 0.07, 0.09, 0.12])
    path = cost_module.cost_path(model.key)
    for _ in range(cost_module.STALE_AFTER - 1):
        budget.observe(None, None, None, verify_s=0.01)
    assert path.is_file()
    budget.fresh().observe(None, None, None, verify_s=0.01)  # a fresh budget starts counting again
    assert path.is_file()
    budget.observe(None, None, None, verify_s=0.01)
    assert not path.is_file() and budget.cost is model and budget.scale == pytest.approx(0.2)
    assert "predicted verifications 5.0x slower" in caplog.text


@pytest.mark.parametrize("observed_s", [0.04, 0.2])
def test_a_cached_cost_model_that_runs_as_measured_or_slower_stays(tmp_path, monkeypatch, observed_s):
    """Verifications at 0.8x or 4x the prediction (a loaded machine now) leave the cached model in place."""
    budget, model = _cached_budget(tmp_path, monkeypatch, [0.05, 0.06, 0.07, 0.09, 0.12])
    for _ in range(2 * cost_module.STALE_AFTER):
        budget.observe(None, None, None, verify_s=observed_s)
    assert cost_module.cost_path(model.key).is_file()


def test_a_cost_model_the_cache_does_not_hold_is_never_removed(tmp_path, monkeypatch):
    """A model given to the budget is judged too, but only the cache file holding that very model is removed."""
    budget, model = _cached_budget(tmp_path, monkeypatch, [0.05, 0.06, 0.07, 0.09, 0.12])
    path = cost_module.cost_path(model.key)
    other = TreeBudget(CostModel(nodes=[1, 2], verify_s=[0.05, 0.06], prefix=8, key=model.key))
    for _ in range(cost_module.STALE_AFTER):
        other.observe(None, None, None, verify_s=0.001)
    assert path.is_file()
    path.write_text(json.dumps({**model.to_dict(), "verify_s": [0.01, 0.02, 0.03, 0.04, 0.05]}))
    for _ in range(cost_module.STALE_AFTER):
        budget.observe(None, None, None, verify_s=0.001)
    assert path.is_file()
    given = TreeBudget(model)  # as taps bench and the serving verifier give it
    path.write_text(json.dumps(model.to_dict()))
    for _ in range(cost_module.STALE_AFTER):
        given.observe(None, None, None, verify_s=0.001)
    assert not path.is_file()
