"""The verifier's decode loop over remote drafters, without Ray: drafting sessions, the resend protocol,
composition equal to the in-process strategies, faults, concurrency, routing and request parsing."""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from taps_ray.config import ServeConfig, TreeConfig
from taps_ray.serving.drafter import Drafter, DraftSessions, SessionAffinityRouter
from taps_ray.serving.drafting import RemoteStrategy, drafter_layers, plan_support
from taps_ray.serving.plan import resolve_plan
from taps_ray.serving.protocol import RequestError
from taps_ray.serving.session import summarize
from taps_ray.serving.verifier import Verifier
from taps_ray.spec.batch import DraftBatcher
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import DecodeState
from taps_ray.spec.tree import DIRECT
from tests.serving.helpers import LocalClient, RecordingSingle, same_tree
from tests.spec.spec_helpers import (
    bigram_target,
    oracle_drafter,
    peaky_tiny_target,
    random_prompt,
    sharp_drafter,
    sharp_eagle3,
)

TREE = TreeConfig(depth=3, top_k=4, total_tokens=12, lookup_tokens=0, adaptive=False)
NEW = 40


@pytest.fixture(scope="module")
def bigram():
    return bigram_target(0)


@pytest.fixture(scope="module")
def drafters(bigram):
    """Even-token and odd-token specialists (exact where the next token is in their vocabulary) and noise."""
    ids = torch.arange(bigram.vocab_size)
    return {"even": oracle_drafter(bigram, ids[ids % 2 == 0]), "odd": oracle_drafter(bigram, ids[ids % 2 == 1]),
            "noise": sharp_drafter(bigram, 7)}


@pytest.fixture(scope="module")
def thirds(bigram):
    """Specialists on ids = 0 and 1 (mod 3): different vocabularies whose union is not the whole vocabulary."""
    ids = torch.arange(bigram.vocab_size)
    return {"zero": oracle_drafter(bigram, ids[ids % 3 == 0]), "one": oracle_drafter(bigram, ids[ids % 3 == 1])}


def serve_cfg(names) -> ServeConfig:
    return ServeConfig(drafters={n: None for n in names})


def remote(bigram, drafters: dict, strategy: str, replicas: int = 1, rid: str = "r", deadline_s: float = 10.0,
           cls=RemoteStrategy, **client_kwargs) -> tuple[RemoteStrategy, dict[str, LocalClient]]:
    """A remote strategy over in-process drafter sessions, drafting over the support the verifier sends."""
    clients = {name: LocalClient([DraftSessions(bigram, d, TREE) for _ in range(replicas)], **client_kwargs)
               for name, d in drafters.items()}
    plan = resolve_plan(strategy, list(drafters), serve_cfg(drafters))
    support, _ = plan_support(plan, clients, bigram.vocab_size, 10.0)
    return cls(rid, plan, clients, deadline_s, TREE.total_tokens, support=support), clients


class Recording:
    """Any strategy, keeping every tree it proposes by root position."""

    def __init__(self, strategy):
        self.strategy, self.name, self.trees = strategy, strategy.name, {}
        self.feature_layers = getattr(strategy, "feature_layers", None)

    def start(self, target, tokens, features):
        self.strategy.start(target, tokens, features)

    def propose(self, state):
        tree = self.trees[state.prefix_len] = self.strategy.propose(state)
        return tree

    def advance(self, tokens, features):
        self.strategy.advance(tokens, features)


class RecordingRemote(RemoteStrategy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trees = {}
        self.prefixes = {}

    def propose(self, state):
        tree = super().propose(state)
        if tree is not None:
            self.trees[state.prefix_len] = tree
            self.prefixes[state.prefix_len] = state.tokens.clone()
        return tree


def test_a_request_an_adapted_version_drafted_is_marked_adapted(bigram, drafters):
    """A request drafted by a ``taps adapt`` version (``version`` in its config) is marked ``adapted`` in its
    ``taps`` block (which withholds its acceptance figures by default); one the configured drafter drafted is
    not."""
    plan = resolve_plan("single", ["even"], serve_cfg(["even"]))
    clients = {"even": LocalClient([DraftSessions(bigram, drafters["even"], TREE)])}
    prompt = random_prompt(bigram, 6, 4)

    def adapted(rid: str) -> bool:
        strategy = RemoteStrategy(rid, plan, clients, 10.0, TREE.total_tokens)
        result = generate(bigram, prompt, strategy, max_new_tokens=NEW)
        strategy.close()
        assert result.steps and all(r.tree_size > 1 for r in result.steps)
        return summarize(plan, result.steps, {}, None, 1.0)["adapted"]

    assert not adapted("configured")
    version = copy.deepcopy(drafters["even"])
    version.metadata["version"] = 3
    clients["even"].replicas[0].swap(version)
    assert adapted("after-the-swap")


def fresh_tree(target, drafter, tokens: torch.Tensor):
    """The tree a new session drafts from the prefix ``tokens`` (root last), features teacher-forced."""
    features = target.hidden_states(tokens[None, :-1])[0]
    return DraftSessions(target, drafter, TREE).propose("fresh", 0, tokens[1:], features)["tree"]


def test_remote_drafters_draft_no_deeper_than_the_step_asks(bigram, drafters):
    """The loop's budget asks each step for a depth; a drafter deployment drafts to it, not to its own tree."""
    prompt = random_prompt(bigram, 6, 2)
    depths = []
    for depth in (1, None, 2):
        strategy, _ = remote(bigram, {"even": drafters["even"]}, "single")
        strategy.start(bigram, prompt[1:], bigram.hidden_states(prompt[None, :-1])[0])
        state = DecodeState(prompt, prompt.numel() - 1, prompt.numel(), 0, depth=depth)
        depths.append(int(strategy.propose(state).depth.max()))
    assert depths == [1, TREE.depth + 1, 2]


@pytest.mark.parametrize("replicas", [1, 2])
def test_remote_single_proposes_the_in_process_trees(bigram, drafters, replicas):
    """Same trees at every step as SingleStrategy, so the same output and acceptance; with two replicas
    every call lands on the other one and the session is rebuilt from the resent pairs each time."""
    prompt = random_prompt(bigram, 6, 1)
    reference = RecordingSingle(drafters["even"], TREE)
    expected = generate(bigram, prompt, reference, max_new_tokens=NEW)
    clients = {"even": LocalClient([DraftSessions(bigram, drafters["even"], TREE) for _ in range(replicas)])}
    strategy = RecordingRemote("r", resolve_plan("single", ["even"], serve_cfg(["even"])), clients, 10.0,
                               TREE.total_tokens)
    result = generate(bigram, prompt, strategy, max_new_tokens=NEW)
    assert result.token_ids == expected.token_ids
    assert result.accept_lengths == expected.accept_lengths and max(result.accept_lengths) >= 2
    assert reference.trees.keys() == strategy.trees.keys()
    assert all(same_tree(reference.trees[k], strategy.trees[k]) for k in reference.trees)
    assert not strategy.skips
    if replicas == 2:
        assert clients["even"].calls > len(result.steps), "a replica switch must trigger a resend"
    strategy.close()
    assert all(len(s) == 0 for s in clients["even"].replicas)


@pytest.mark.parametrize("name", ["routed:confidence", "routed:entropy", "routed:confidence:request", "merged:union",
                                  "merged:budget"])
@pytest.mark.slow
@pytest.mark.parametrize("team", ["drafters", "thirds"])
def test_remote_composition_equals_in_process_compose(request, bigram, team, name):
    """Greedy, float32: the same trees (the drafting support included), decisions and output as the
    in-process strategy, for drafters of different vocabularies (even / odd / whole, whose union is the
    whole vocabulary, and 0 / 1 mod 3, whose union is not)."""
    drafters = request.getfixturevalue(team)
    prompt = random_prompt(bigram, 6, 2)
    reference = Recording(build_strategy(name, drafters, TREE))
    expected = generate(bigram, prompt, reference, max_new_tokens=NEW)
    strategy, _ = remote(bigram, drafters, name, cls=RecordingRemote)
    if team == "thirds":
        ids = torch.arange(bigram.vocab_size)
        assert torch.equal(strategy.support, ids[ids % 3 < 2]), "the union of the two vocabularies"
    result = generate(bigram, prompt, strategy, max_new_tokens=NEW)
    assert result.token_ids == expected.token_ids
    assert result.accept_lengths == expected.accept_lengths
    assert [s.tree_size for s in result.steps] == [s.tree_size for s in expected.steps]
    assert reference.trees.keys() == strategy.trees.keys()
    for prefix, tree in strategy.trees.items():
        assert same_tree(reference.trees[prefix], tree) and torch.equal(reference.trees[prefix].entropy, tree.entropy)
        mine, theirs = tree.support, reference.trees[prefix].support
        assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine, theirs))
    for mine, theirs in zip(result.steps, expected.steps):
        for key in ("route", "decision", "probe", "union_size", "verified_size"):
            assert mine.meta.get(key) == theirs.meta.get(key), key
    summary = summarize(strategy.plan, result.steps, strategy.skip_counts, 0.0, 1.0)
    assert summary["steps"] == len(result.steps) and summary["accepted_tokens"] == sum(result.accept_lengths)
    if name.startswith("routed"):
        assert sum(summary["route_decisions"].values()) == len(result.steps)


class CountingClient(LocalClient):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked = 0

    def vocabulary(self):
        self.asked += 1
        return super().vocabulary()


@pytest.mark.slow
def test_the_verifier_drafts_over_one_support_per_set_of_drafters(bigram, thirds, monkeypatch):
    """Served greedy output equals the in-process strategy's for two drafters of different vocabularies;
    the verifier asks their vocabularies once per set of drafters (any order, any composing plan), and
    asks again after a drafter swapped to a vocabulary outside it (that request skips the drafter and
    stays exact)."""
    from concurrent.futures import ThreadPoolExecutor

    from taps_ray.serving.plan import DecodeRequest

    monkeypatch.setattr(bigram, "tokenizer",
                        SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids))))
    sessions = {name: DraftSessions(bigram, d, TREE) for name, d in thirds.items()}
    verifier = object.__new__(Verifier)
    verifier.target, verifier.tree = bigram, TREE
    verifier.cfg = ServeConfig(drafters={n: None for n in thirds}, routing={"draft_deadline_s": 10.0})
    verifier.clients = {name: CountingClient([s]) for name, s in sessions.items()}
    verifier.pool = ThreadPoolExecutor(1)
    verifier._init_counts()

    def serve(strategy: str, order: list[str], seed: int) -> tuple[dict, list[int]]:
        prompt = random_prompt(bigram, 6, seed)
        plan = resolve_plan(strategy, order, verifier.cfg)
        events = []
        verifier.decode(DecodeRequest(rid=f"r{seed}", prompt=prompt.tolist(), plan=plan, max_tokens=NEW, raw=True,
                                      prompt_param="prompt"), events.append)
        assert events[-1]["type"] == "done", events[-1]
        expected = generate(bigram, prompt, build_strategy(strategy, {n: thirds[n] for n in order}, TREE),
                            max_new_tokens=NEW)
        assert events[-1]["text"] == " ".join(map(str, expected.token_ids))
        return events[-1]["taps"], expected.token_ids

    taps, _ = serve("routed:confidence", ["zero", "one"], 1)
    assert taps["drafted_steps"] == taps["steps"] and not taps["skipped"]
    serve("merged:budget", ["one", "zero"], 2)
    serve("routed:entropy", ["zero", "one"], 3)
    assert [c.asked for c in verifier.clients.values()] == [1, 1]
    ids = torch.arange(bigram.vocab_size)
    sessions["one"].swap(oracle_drafter(bigram, ids[ids % 3 == 2]))
    taps, _ = serve("routed:confidence", ["zero", "one"], 4)
    assert taps["skipped"]["one"]["vocabulary"] >= 1 and "zero" not in taps["skipped"]
    sessions["one"].swap(thirds["one"])
    taps, _ = serve("routed:confidence", ["zero", "one"], 5)
    assert not taps["skipped"] and [c.asked for c in verifier.clients.values()] == [2, 2]
    verifier.pool.shutdown()


@pytest.mark.parametrize("name", ["routed:confidence", "merged:budget"])
def test_served_release_drafters_equal_the_in_process_strategy(embedded_target, name):
    """The shipped release drafters (``release:math``, ``release:chat``: different draft vocabularies) on the
    embedded target, greedy float32: the served routed / budget-merged output, routes and acceptance equal
    the in-process strategy's."""
    from taps_ray.spec.decoder import load_drafter

    drafters = {n: load_drafter(embedded_target, f"release:{n}", 0) for n in ("math", "chat")}
    assert not torch.equal(drafters["math"].draft_to_target.sort().values, drafters["chat"].draft_to_target.sort().values)
    tree = TreeConfig(depth=2, top_k=3, total_tokens=8, lookup_tokens=0, adaptive=False)
    messages = [{"role": "user", "content": "What is 7 times 8?"}]
    expected = generate(embedded_target, messages, build_strategy(name, drafters, tree), max_new_tokens=16)
    clients = {n: LocalClient([DraftSessions(embedded_target, d, tree)]) for n, d in drafters.items()}
    plan = resolve_plan(name, list(drafters), serve_cfg(drafters))
    support, complete = plan_support(plan, clients, embedded_target.vocab_size, 30.0)
    assert complete and support is not None
    strategy = RemoteStrategy("r", plan, clients, 30.0, tree.total_tokens, support=support)
    result = generate(embedded_target, messages, strategy, max_new_tokens=16)
    assert result.token_ids == expected.token_ids and result.accept_lengths == expected.accept_lengths
    assert [s.meta.get("route") for s in result.steps] == [s.meta.get("route") for s in expected.steps]
    assert not strategy.skips


def test_an_adaptive_verifier_sizes_trees_by_its_cost_model_and_stays_greedy(bigram, thirds, monkeypatch):
    """With ``tree.adaptive`` the verifier measures its cost model once, sizes each step of a plan by that
    plan's one budget (shared across its requests, counting the batch) and reports the model in the
    ``taps`` block and ``info``; the output is vanilla's, and the summary's step counts are the loop's."""
    from taps_ray.serving.plan import DecodeRequest
    from taps_ray.spec.cost import TreeBudget

    monkeypatch.setattr(bigram, "tokenizer",
                        SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids))))
    tree = TREE.model_copy(update={"adaptive": True})
    verifier = object.__new__(Verifier)
    verifier.target, verifier.tree = bigram, tree
    verifier.cfg = ServeConfig(drafters={n: None for n in thirds}, routing={"draft_deadline_s": 10.0})
    verifier.clients = {name: LocalClient([DraftSessions(bigram, d, tree)]) for name, d in thirds.items()}
    verifier.pool = ThreadPoolExecutor(1)
    verifier._init_counts()
    assert verifier.info()["cost_model"]["relative"][1] == 1.0
    for seed in (1, 2):
        prompt = random_prompt(bigram, 6, seed)
        plan = resolve_plan("merged:budget", ["zero", "one"], verifier.cfg)
        events = []
        verifier.decode(DecodeRequest(rid=f"r{seed}", prompt=prompt.tolist(), plan=plan, max_tokens=NEW, raw=True,
                                      prompt_param="prompt"), events.append)
        done = events[-1]
        assert done["type"] == "done", done
        assert done["text"] == " ".join(map(str, generate(bigram, prompt, max_new_tokens=NEW).token_ids))
        taps = done["taps"]
        assert taps["cost_model"] == verifier.cost_info() and taps["steps"] == len(taps["accept_lengths"])
        assert taps["drafted_steps"] + taps["plain_steps"] == taps["steps"]
    [budget] = verifier.budgets.values()
    assert isinstance(budget, TreeBudget) and budget.cost is verifier.cost and len(budget.chosen) > 0
    verifier.pool.shutdown()


class MuteClient(LocalClient):
    """Drafts, but never reports its vocabulary."""

    def vocabulary(self):
        raise RuntimeError("injected: no vocabulary")


@pytest.mark.parametrize("mute", [["one"], ["zero", "one"]])
def test_drafters_that_do_not_report_their_vocabulary_are_skipped_not_compared(bigram, thirds, mute):
    """A support over the drafters that answered is incomplete (not kept); a drafter it misses answers
    ``unsupported``; with no support at all, routing keeps the first answering drafter's support. Either
    way no signals over different supports are compared and the output stays greedy."""
    prompt = random_prompt(bigram, 6, 7)
    expected = generate(bigram, prompt, max_new_tokens=NEW)
    clients = {name: (MuteClient if name in mute else LocalClient)([DraftSessions(bigram, d, TREE)])
               for name, d in thirds.items()}
    plan = resolve_plan("routed:confidence", ["zero", "one"], serve_cfg(thirds))
    support, complete = plan_support(plan, clients, bigram.vocab_size, 10.0)
    assert not complete and (support is None) == (len(mute) == 2)
    strategy = RemoteStrategy("r", plan, clients, 10.0, TREE.total_tokens, support=support)
    result = generate(bigram, prompt, strategy, max_new_tokens=NEW)
    assert result.token_ids == expected.token_ids
    assert set(strategy.skip_counts) == {"one"} and strategy.skip_counts["one"]["vocabulary"] >= 1
    assert all(s.tree_size > 1 for s in result.steps), "the other drafter drafts every step"


def test_a_stop_sequence_trims_the_appended_count_of_its_step(bigram, drafters):
    """A stop inside a step's tokens ends the request there: the taps block counts the tokens the
    response kept (as EOS trimming does), not the step's accepted + 1."""
    prompt = random_prompt(bigram, 6, 1)
    reference = generate(bigram, prompt, build_strategy("single", [drafters["even"]], TREE), max_new_tokens=NEW)
    appended = [s.appended for s in reference.steps]
    cut = next(i for i, n in enumerate(appended[:-1]) if n >= 2)
    kept = 1 + sum(appended[:cut]) + 1
    counted = copy.copy(bigram)
    counted.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "x" * len(ids))
    clients = {"even": LocalClient([DraftSessions(counted, drafters["even"], TREE)])}
    strategy = RemoteStrategy("r", resolve_plan("single", ["even"], serve_cfg(["even"])), clients, 10.0,
                              TREE.total_tokens)
    result = generate(counted, prompt, strategy, max_new_tokens=NEW, stop=["x" * kept])
    assert result.finish_reason == "stop" and result.token_ids == reference.token_ids[:kept]
    summary = summarize(strategy.plan, result.steps, strategy.skip_counts, None, 1.0)
    assert summary["steps"] == cut + 1
    assert summary["tau"] == pytest.approx((sum(appended[:cut]) + 1) / (cut + 1))
    assert summary["accept_lengths"] == reference.accept_lengths[:cut + 1]


def test_failed_and_late_drafters_are_skipped_and_output_stays_lossless(bigram, drafters):
    prompt = random_prompt(bigram, 6, 3)
    vanilla = generate(bigram, prompt, max_new_tokens=NEW)
    clients = {"even": LocalClient([DraftSessions(bigram, drafters["even"], TREE)], fail={1, 2}, slow={4},
                                   delay_s=0.6)}
    strategy = RecordingRemote("r", resolve_plan("single", None, serve_cfg(["even"])), clients, 0.2, TREE.total_tokens)
    result = generate(bigram, prompt, strategy, max_new_tokens=NEW)
    assert result.token_ids == vanilla.token_ids
    assert strategy.skip_counts == {"even": {"error": 2, "backoff": 1, "deadline": 1}}
    plain = [s.tree_size == 1 for s in result.steps]
    assert [i for i, p in enumerate(plain) if p] == [1, 2, 3, 5], "two failures in a row sit out one step"
    assert len(strategy.trees) == len(result.steps) - 4
    for prefix, tree in strategy.trees.items():
        expected = fresh_tree(bigram, drafters["even"], strategy.prefixes[prefix])
        assert same_tree(expected, tree), "after a skip the drafter must catch up exactly"


def test_without_any_drafter_the_verifier_decodes_plainly(bigram, drafters):
    prompt = random_prompt(bigram, 6, 4)
    vanilla = generate(bigram, prompt, max_new_tokens=20)
    strategy, clients = remote(bigram, {k: drafters[k] for k in ("even", "odd")}, "merged:union",
                               fail=set(range(1000)))
    result = generate(bigram, prompt, strategy, max_new_tokens=20)
    assert result.token_ids == vanilla.token_ids
    assert all(s.tree_size == 1 for s in result.steps)
    steps = len(result.steps)
    for name in ("even", "odd"):
        counts = strategy.skip_counts[name]
        assert counts["error"] + counts["backoff"] == steps and counts["error"] <= 6, "backoff bounds the calls"
    assert clients["even"].calls == strategy.skip_counts["even"]["error"]


def test_lookup_drafts_alone_when_no_drafter_answers_and_stays_lossless(bigram, drafters):
    """The bigram target's greedy text cycles, so prompt lookup finds copies even with every drafter down."""
    prompt = random_prompt(bigram, 6, 4)
    vanilla = generate(bigram, prompt, max_new_tokens=60)
    clients = {"even": LocalClient([DraftSessions(bigram, drafters["even"], TREE)], fail=set(range(1000)))}
    plan = resolve_plan("single", None, serve_cfg(["even"]))
    strategy = RemoteStrategy("r", plan, clients, 10.0, TREE.total_tokens, lookup=TreeConfig(lookup_tokens=5))
    result = generate(bigram, prompt, strategy, max_new_tokens=60)
    assert result.token_ids == vanilla.token_ids
    assert max(s.accepted for s in result.steps) == 5 and len(result.steps) < 40


def test_a_node_budget_cuts_each_tree_and_one_node_decodes_plainly_without_asking(bigram, drafters):
    """Budget 4 for 5 steps, then 1 for 5, then none (the decode loop's node limit): the drafters' trees are
    the full trees (the loop cuts them), the budget-1 steps are plain and ask no drafter (the next call
    catches the session up), every cut is counted in the taps block, and the output stays the target's."""
    prompt = random_prompt(bigram, 6, 2)
    vanilla = generate(bigram, prompt, max_new_tokens=NEW)
    budgets = iter([4] * 5 + [1] * 5)
    plan = resolve_plan("single", ["even"], serve_cfg(["even"]))
    clients = {"even": LocalClient([DraftSessions(bigram, drafters["even"], TREE)])}
    strategy = RecordingRemote("r", plan, clients, 10.0, TREE.total_tokens)
    result = generate(bigram, prompt, strategy, max_new_tokens=NEW, node_limit=lambda: next(budgets, 1000))
    assert result.token_ids == vanilla.token_ids
    sizes = [step.tree_size for step in result.steps]
    assert sizes[:5] == [4] * 5 and sizes[5:10] == [1] * 5 and max(sizes[10:]) > 4
    assert clients["even"].calls == len(sizes) - 5, "a budget of one node must not ask the drafters"
    for prefix, tree in strategy.trees.items():
        assert same_tree(fresh_tree(bigram, drafters["even"], strategy.prefixes[prefix]), tree)
    taps = summarize(plan, result.steps, strategy.skip_counts, 0.0, 1.0)
    assert taps["shrunk_steps"] == 10 and taps["plain_steps"] == 5
    assert taps["shed_draft_tokens"] == sum(s.shed for s in result.steps) == 5 * (TREE.total_tokens - 4)
    strategy.close()


@pytest.mark.parametrize("active, expected", [(0, 32), (1, 32), (2, 16), (4, 8), (6, 5), (8, 4), (16, 4)])
def test_the_verifier_shares_batch_max_tokens_among_the_requests_of_a_batch(active, expected):
    verifier = object.__new__(Verifier)
    verifier.cfg = ServeConfig(drafters={"a": None}, batching={"max_tokens": 32, "max_requests": 8, "min_tree_nodes": 4})
    verifier.active = active
    assert verifier.node_budget() == expected
    verifier.cfg = ServeConfig(drafters={"a": None}, batching={"max_tokens": 32, "max_requests": 8, "min_tree_nodes": 5})
    assert verifier.node_budget() == (1 if expected < 5 else expected), "below min_tree_nodes: a plain step"


def test_a_drafter_replica_drafts_concurrent_sessions_together(bigram, drafters):
    """Four requests' proposes reach a batching replica at once (three rounds): each answer equals the
    tree a one-at-a-time replica drafts, and the drafter's forwards ran in batches."""
    def replica(batch_sessions: int) -> Drafter:
        made = object.__new__(Drafter)
        made.name, made.threads, made.fault, made.delay_s, made.drafting = "even", None, None, 0.0, 0
        made.pool = ThreadPoolExecutor(batch_sessions)
        made.compute = DraftBatcher(batch_sessions, 0.05, expected=lambda: made.drafting) if batch_sessions > 1 \
            else DIRECT
        made.sessions = DraftSessions(bigram, drafters["even"], TREE, compute=made.compute)
        return made

    prompts = [random_prompt(bigram, 5 + i, 20 + i) for i in range(4)]
    features = [bigram.hidden_states(p[None])[0] for p in prompts]

    async def rounds(made: Drafter) -> list:
        trees = []
        for round_ in range(3):
            calls = []
            for i, prompt in enumerate(prompts):
                if round_ == 0:
                    calls.append(made.propose(f"r{i}", 0, prompt[1:], features[i][:-1]))
                else:
                    held = prompt.numel() - 1 + 2 * (round_ - 1)
                    tokens = trees[-len(prompts) + i].tokens[1:3]
                    calls.append(made.propose(f"r{i}", held, tokens, torch.ones(2, bigram.hidden_size) * round_))
            trees += [answer["tree"] for answer in await asyncio.gather(*calls)]
        return trees

    together, alone = replica(4), replica(1)
    batched, expected = asyncio.run(rounds(together)), asyncio.run(rounds(alone))
    assert all(same_tree(a, b) for a, b in zip(batched, expected, strict=True))
    assert max(together.compute.forwards.sizes) > 1 and max(together.compute.heads.sizes) > 1


@pytest.mark.slow
def test_concurrent_requests_on_shared_sessions_stay_isolated(bigram, drafters):
    sessions = {n: DraftSessions(bigram, drafters[n], TREE) for n in ("even", "odd")}
    clients = {n: LocalClient([s]) for n, s in sessions.items()}
    prompts = [random_prompt(bigram, 5 + i, 10 + i) for i in range(6)]
    names = ["single", "merged:union", "routed:confidence"] * 2
    expected = [generate(bigram, p, build_strategy(n, {k: drafters[k] for k in ("even", "odd")}, TREE),
                         max_new_tokens=30) for p, n in zip(prompts, names)]
    results = [None] * len(prompts)

    def run(i: int) -> None:
        plan = resolve_plan(names[i], None if names[i] == "single" else ["even", "odd"], serve_cfg(["even", "odd"]))
        support, _ = plan_support(plan, clients, bigram.vocab_size, 10.0)
        strategy = RemoteStrategy(f"req-{i}", plan, clients, 10.0, TREE.total_tokens, support=support)
        try:
            results[i] = generate(bigram, prompts[i], strategy, max_new_tokens=30)
        finally:
            strategy.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected):
        assert got.token_ids == want.token_ids and got.accept_lengths == want.accept_lengths
    assert all(len(s) == 0 for s in sessions.values())


def test_session_protocol_resend_duplicates_supersede_end_and_reap(bigram, drafters):
    sessions = DraftSessions(bigram, drafters["even"], TREE, ttl_s=30.0)
    tokens = random_prompt(bigram, 10, 5)
    features = bigram.hidden_states(tokens[None])[0]
    pairs = tokens[1:], features[:-1]
    assert sessions.propose("a", 3, pairs[0][3:6], pairs[1][3:6]) == {"need": 0}
    first = sessions.propose("a", 0, pairs[0][:6], pairs[1][:6])
    assert first["held"] == 6 and first["tree"].prefix_len == 6
    again = sessions.propose("a", 4, pairs[0][4:6], pairs[1][4:6])
    assert again["tree"] is first["tree"], "pairs already held are skipped and the tree is reused"
    assert sessions.propose("a", 7, pairs[0][7:], pairs[1][7:]) == {"need": 6}
    after = sessions.propose("a", 4, pairs[0][4:], pairs[1][4:])
    fresh = DraftSessions(bigram, drafters["even"], TREE).propose("b", 0, pairs[0], pairs[1])
    assert after["held"] == 9 and same_tree(after["tree"], fresh["tree"])
    session = sessions._sessions["a"]
    session.wanted = 20
    stale = sessions.propose("a", 9, pairs[0][:0], pairs[1][:0])
    assert stale == {"superseded": True, "held": 9}
    assert "a" in sessions and sessions.end("a") and "a" not in sessions and not sessions.end("a")
    sessions.propose("c", 0, pairs[0][:3], pairs[1][:3])
    assert sessions.reap(now=session.last_used + 10.0) == 0 and len(sessions) == 1
    assert sessions.reap(now=session.last_used + 1e6) == 1 and len(sessions) == 0


def test_a_swapped_drafter_serves_new_sessions_only(bigram, drafters):
    sessions = DraftSessions(bigram, drafters["even"], TREE)
    tokens = random_prompt(bigram, 8, 6)
    features = bigram.hidden_states(tokens[None])[0]
    old = sessions.propose("old", 0, tokens[1:5], features[:4])["tree"]
    sessions.swap(drafters["odd"])
    kept = sessions.propose("old", 4, tokens[5:], features[4:-1])["tree"]
    new = sessions.propose("new", 0, tokens[1:], features[:-1])["tree"]
    reference_even = DraftSessions(bigram, drafters["even"], TREE).propose("x", 0, tokens[1:], features[:-1])["tree"]
    assert old.prefix_len == 4 and same_tree(kept, reference_even) and not same_tree(new, reference_even)


def _replica(name: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def _route(replicas, rid: str):
    request = SimpleNamespace(args=[rid, 0])
    return asyncio.run(SessionAffinityRouter.choose_replicas(None, replicas, request))


def test_session_affinity_router_is_sticky_and_moves_only_a_lost_replicas_requests():
    replicas = [_replica(f"r{i}") for i in range(3)]
    first = {f"req-{i}": _route(replicas, f"req-{i}")[0][0].replica_id.unique_id for i in range(60)}
    assert first == {rid: _route(list(reversed(replicas)), rid)[0][0].replica_id.unique_id for rid in first}
    assert set(first.values()) == {"r0", "r1", "r2"}
    ranks = _route(replicas, "req-0")
    assert len(ranks[0]) == 1 and {r.replica_id.unique_id for r in ranks[0] + ranks[1]} == {"r0", "r1", "r2"}
    survivors = [r for r in replicas if r.replica_id.unique_id != "r1"]
    for rid, owner in first.items():
        moved = _route(survivors, rid)[0][0].replica_id.unique_id
        assert moved == owner or owner == "r1"
    assert _route(replicas, None) is not None


@pytest.mark.parametrize("strategy, drafters, expect", [
    (None, None, ("single", ("a",))),
    ("single:b", None, ("single:b", ("b",))),
    ("single", ["b"], ("single", ("b",))),
    ("vanilla", None, ("vanilla", ())),
    ("routed:entropy", None, ("routed:entropy:request", ("a", "b"))),
    ("merged:budget", ["b", "a"], ("merged:budget", ("b", "a"))),
    ("averaged:0.25", None, ("averaged:0.25", ("avg",))),
    ("averaged:0.25", ["a", "b"], ("averaged:0.25", ("avg",))),
])
def test_resolve_plan(strategy, drafters, expect):
    cfg = ServeConfig(drafters={"a": None, "b": None, "avg": {"average_of": ["a", "b"], "alpha": 0.25}})
    plan = resolve_plan(strategy, drafters, cfg)
    assert (plan.name, plan.drafters) == expect


@pytest.mark.parametrize("strategy, drafters, param, message", [
    ("routed", None, "taps.strategy", "unknown strategy 'routed'"),
    ("single:zzz", None, "taps.strategy", "unknown drafter 'zzz'"),
    ("single", ["zzz"], "taps.drafters", r"unknown drafter\(s\) \['zzz'\]"),
    ("single", ["a", "b"], "taps.drafters", "takes one drafter"),
    ("merged:union", ["a"], "taps.drafters", "composes 2 or more distinct drafters"),
    ("merged:union", ["a", "a"], "taps.drafters", "distinct"),
    ("averaged:0.5", None, "taps.strategy", "no averaged drafter with alpha 0.5"),
])
def test_resolve_plan_errors_name_the_field(strategy, drafters, param, message):
    cfg = ServeConfig(drafters={"a": None, "b": None, "avg": {"average_of": ["a", "b"], "alpha": 0.25}})
    with pytest.raises(RequestError, match=message) as err:
        resolve_plan(strategy, drafters, cfg)
    assert err.value.param == param and err.value.status == 400


class WidthClient(LocalClient):
    """A :class:`LocalClient` recording the width of the features each call ships."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.widths: set[int] = set()

    def propose(self, rid, offset, tokens, features, support=None, depth=None):
        self.widths.add(features.shape[-1])
        return super().propose(rid, offset, tokens, features, support, depth)


@pytest.mark.parametrize("name", ["single", "routed:confidence", "routed:entropy:request", "merged:union",
                                  "merged:budget"])
@pytest.mark.slow
def test_served_eagle3_and_eagle2_drafters_equal_the_in_process_strategy(name):
    """An EAGLE-3 drafter (reduced vocabulary) beside an EAGLE-2 one, served: each deployment reports the
    target layers it reads, the verifier asks the target for their union and ships each drafter its own
    columns (3H and H), and trees, output and acceptance equal the in-process strategy's and vanilla's."""
    target = peaky_tiny_target(6, layers=8)
    drafters = {"e3": sharp_eagle3(target, 1, vocab=torch.arange(2, 220)), "e2": sharp_drafter(target, 2)}
    if name == "single":
        drafters = {"e3": drafters["e3"]}
    prompt = random_prompt(target, 8, 3)
    reference = Recording(build_strategy(name, drafters, TREE))
    expected = generate(target, prompt, reference, max_new_tokens=NEW)
    clients = {n: WidthClient([DraftSessions(target, d, TREE)]) for n, d in drafters.items()}
    layers = drafter_layers(list(drafters), clients, 10.0)
    assert layers == {n: d.feature_layers for n, d in drafters.items()}
    plan = resolve_plan(name, list(drafters), serve_cfg(drafters))
    support, _ = plan_support(plan, clients, target.vocab_size, 10.0)
    strategy = RecordingRemote("r", plan, clients, 10.0, TREE.total_tokens, support=support, layers=layers)
    assert strategy.feature_layers == ((2, 4, 5) if name == "single" else (2, 4, 5, 8))
    result = generate(target, prompt, strategy, max_new_tokens=NEW)
    assert result.token_ids == expected.token_ids == generate(target, prompt, max_new_tokens=NEW).token_ids
    assert result.accept_lengths == expected.accept_lengths
    assert reference.trees.keys() == strategy.trees.keys()
    assert all(same_tree(reference.trees[k], strategy.trees[k]) for k in reference.trees)
    assert not strategy.skips
    assert clients["e3"].widths == {3 * target.hidden_size}
    if "e2" in clients:
        assert clients["e2"].widths == {target.hidden_size}
    strategy.close()
    with pytest.raises(ValueError, match="no feature layers for drafter"):
        RemoteStrategy("x", plan, clients, 10.0, TREE.total_tokens, layers={})


def test_a_served_drafter_does_not_swap_to_one_reading_other_layers():
    target = peaky_tiny_target(6, layers=8)
    sessions = DraftSessions(target, sharp_drafter(target, 1), TREE)
    with pytest.raises(ValueError, match=r"cannot swap a TapsDraftHead drafter reading target layers \[8\] for a "
                                         r"TapsEagle3Head one reading \[2, 4, 5\]"):
        sessions.swap(sharp_eagle3(target, 2))
    assert sessions.layers() == [8]
    sessions.swap(sharp_drafter(target, 3))
