"""Composing drafters (TAPS): single, averaged, routed (confidence | entropy), merged (union | budget).

Every strategy drafts from the same prefix with K >= 1 drafters of one target; ``N`` is
``tree_cfg.total_tokens`` (verified nodes of one tree, root included).

- ``single[:NAME]``: one drafter's EAGLE-2 tree.
- ``averaged[:ALPHA]``: one drafter whose weights are ``alpha * theta_A + (1 - alpha) * theta_B``
  (two drafters), or the uniform average of K drafters (no ALPHA), then as ``single``.
- ``routed:SIGNAL[:GRANULARITY]``: verify the tree of one drafter, chosen by the mean node
  confidence ``exp(score)`` (higher wins) or the mean node entropy (lower wins) over non-root
  nodes. Drafters with different draft vocabularies draft over the union of their vocabularies
  (:func:`common_support`), so a smaller vocabulary does not make a drafter look more confident;
  :func:`compose_trees` refuses to compare trees over different supports. ``step`` drafts with
  all K and picks every step (the TAPS default for confidence);
  ``request`` decides from the mean signal of a probe window of ``probe_steps`` steps, then drafts
  with the chosen drafter only, re-probing every ``recheck_every`` steps (0: never, i.e. once per
  turn, the TAPS default for entropy). Drafters left out keep their accepted pairs queued and run
  them all at once when they next draft.
- ``merged:union``: the trie union of the K trees (identical root paths become one node), verified
  at once; its size is about ``1 + K (N - 1)``.
- ``merged:budget``: the union pruned to the root plus its ``N - 1`` most confident nodes
  (ancestor-closed, scores over the common support as for routing), so it costs one tree's
  verification.

Each proposed tree carries its decision in ``tree.meta``, which the decoder records per step:
routed: ``route`` (drafter name), ``route_index``, ``signal``, ``signals`` [K] (every drafter's
signal this step, NaN for drafters that did not draft), ``probe``, and for ``request``
``decision`` (the request's current choice, None before the first); merged: ``tree_sizes`` [K],
``union_size``, ``verified_size``, ``node_sources`` [K] (verified nodes each drafter proposed),
``shared_nodes`` (verified nodes proposed by more than one drafter).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from taps_ray.config import TreeConfig
from taps_ray.models.drafter import DraftHead, average_drafters
from taps_ray.models.target import TargetModel, union_layers
from taps_ray.spec.cost import TreeBudget
from taps_ray.spec.lookup import graft_lookup
from taps_ray.spec.protocol import DecodeState, SingleStrategy, Strategy, VanillaStrategy
from taps_ray.spec.strategy import GRANULARITIES, SIGNALS, StrategySpec, parse_strategy
from taps_ray.spec.tree import DrafterState, DraftTree, draft_tree, merge_trees, same_support

_SIZE_FIELDS = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim")


def check_drafters(drafters: Sequence[DraftHead], names: Sequence[str], target: TargetModel | None = None) -> None:
    """ValueError when the drafters do not share one target's sizes and draft vocabulary (or do not fit
    ``target``); the message names the drafters and the differing field."""
    first = drafters[0]
    for name, head in zip(names[1:], drafters[1:]):
        for key in _SIZE_FIELDS:
            a, b = getattr(first.config, key, None), getattr(head.config, key, None)
            if a != b:
                raise ValueError(f"drafters {names[0]!r} and {name!r} belong to different targets: "
                                 f"{key} {a} vs {b}")
    if target is not None:
        for name, head in zip(names, drafters):
            for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
                if getattr(head.config, key) != want:
                    raise ValueError(f"drafter {name!r} does not fit target {target.name!r}: "
                                     f"{key} {getattr(head.config, key)} vs {want}")


def common_support(drafters: Sequence[DraftHead]) -> torch.Tensor | None:
    """The sorted union [S] of the drafters' draft vocabularies (target ids; a drafter without one brings
    the whole target vocabulary), or None when all drafters share one draft vocabulary (their scores
    already compare)."""
    return union_support([d.draft_to_target for d in drafters], drafters[0].config.vocab_size)


def union_support(vocabularies: Sequence[torch.Tensor | None], vocab_size: int) -> torch.Tensor | None:
    """:func:`common_support` from the draft vocabularies themselves (``draft_to_target`` [V_draft] target
    ids, None: the whole target vocabulary of ``vocab_size`` ids), for callers that do not hold the
    drafters (the serving verifier)."""
    first = vocabularies[0]
    if all(v is None for v in vocabularies) or (
            first is not None and all(v is not None and torch.equal(v.sort().values, first.sort().values)
                                      for v in vocabularies[1:])):
        return None
    present = [v for v in vocabularies if v is not None]
    if len(present) < len(vocabularies):
        return torch.arange(vocab_size)
    return torch.cat([v.cpu() for v in present]).unique()


def check_comparable(trees: Sequence[DraftTree | None], names: Sequence[str], what: str) -> None:
    """ValueError naming two drafters whose trees' scores and entropies are over different target-id
    supports (see :attr:`DraftTree.support`), which ``what`` (routing, budget merging) would compare."""
    present = [(i, t) for i, t in enumerate(trees) if t is not None]
    first, a = present[0][0], present[0][1].support
    for i, tree in present[1:]:
        b = tree.support
        if not same_support(a, b):
            raise ValueError(f"cannot {what} drafters {names[first]!r} and {names[i]!r}: their signals are over "
                             f"different draft vocabularies ({_support_name(a)} vs {_support_name(b)}); draft "
                             f"them over one support (taps_ray.spec.compose.common_support)")


def _support_name(support: torch.Tensor | None) -> str:
    return "the whole target vocabulary" if support is None else f"{support.numel()} target ids"


def tree_signal(tree: DraftTree, signal: str) -> torch.Tensor:
    """0-dim mean over the non-root nodes: confidence ``exp(score)`` or draft ``entropy`` (NaN for a bare root)."""
    values = tree.score[1:].exp() if signal == "confidence" else tree.entropy[1:]
    return values.float().mean() if values.numel() else torch.tensor(math.nan)


def best_index(values: torch.Tensor, signal: str) -> int:
    """The index of the best of ``values`` [K]: highest confidence or lowest entropy; NaN never wins."""
    goodness = values if signal == "confidence" else -values
    return int(goodness.nan_to_num(-math.inf, -math.inf, math.inf).argmax())


def compose_trees(spec: StrategySpec, trees: Sequence[DraftTree | None], names: Sequence[str],
                  total_tokens: int) -> tuple[DraftTree, dict]:
    """One step of composition, pure: the tree to verify from one tree per drafter (None: that drafter
    gave none this step) and the decision meta (see the module doc). ``routed`` picks by ``spec.signal``
    (NaN for missing drafters); ``merged`` is the trie union of the trees given, pruned to the root and
    the ``total_tokens - 1`` most confident nodes for ``budget``; anything else takes the first tree.
    ``routed`` and ``budget`` compare scores across trees: ValueError (:func:`check_comparable`) when
    the trees' supports differ."""
    given = {i: t for i, t in enumerate(trees) if t is not None}
    present = list(given)
    if not present:
        raise ValueError("compose_trees needs at least one tree")
    if spec.kind == "routed":
        check_comparable(trees, names, "route between")
        signal = spec.signal or "confidence"
        values = torch.stack([tree_signal(t, signal) if t is not None else torch.tensor(math.nan) for t in trees])
        pick = best_index(values, signal)
        pick = pick if pick in given else present[0]
        return given[pick], {"route": names[pick], "route_index": pick, "signal": signal, "signals": values}
    if spec.kind == "merged":
        if spec.merge == "budget":
            check_comparable(trees, names, "merge with a budget")
        device = given[present[0]].tokens.device
        merged = merge_trees([t.to("cpu") for t in given.values()])
        sources = torch.zeros(merged.size, len(trees), dtype=torch.bool)
        sources[:, present] = merged.meta.pop("sources")
        union_size = merged.size
        if spec.merge == "budget" and merged.size > total_tokens:
            keep = merged.top_nodes(total_tokens)
            merged, sources = merged.select(keep), sources[keep]
        return merged.to(device), {
            "tree_sizes": torch.tensor([t.size if t is not None else 0 for t in trees]),
            "union_size": union_size,
            "verified_size": merged.size,
            "node_sources": sources[1:].sum(0),
            "shared_nodes": (sources[1:].sum(1) > 1).sum(),
        }
    return given[present[0]], {}


class RequestRoute:
    """Routing decided per request: every drafter drafts for ``probe_steps`` steps, the best mean signal
    wins, and the winner drafts alone, with a new probe window every ``recheck_every`` steps (0: never)."""

    def __init__(self, signal: str, probe_steps: int = 2, recheck_every: int = 0):
        self.signal = signal
        self.probe_steps = probe_steps
        self.recheck_every = recheck_every
        self.choice: int | None = None
        self.window: torch.Tensor | None = None
        self.window_steps = 0

    def probing(self, step: int) -> bool:
        """Whether step ``step`` (0-based within the request) drafts with every drafter."""
        if self.choice is None:
            return True
        if self.recheck_every == 0:
            return step < self.probe_steps
        return step % (self.probe_steps + self.recheck_every) < self.probe_steps

    def observe(self, signals: torch.Tensor) -> int | None:
        """Add a probe step's signals [K]; the new choice when the window completes, else None."""
        self.window = signals if self.window is None else self.window + signals
        self.window_steps += 1
        if self.window_steps < self.probe_steps:
            return None
        self.choice = best_index(self.window / self.window_steps, self.signal)
        self.window, self.window_steps = None, 0
        return self.choice


class _Ensemble:
    """K drafters with one :class:`DrafterState` each; accepted pairs are queued for all of them."""

    tree_budget: TreeBudget | None = None

    def __init__(self, drafters: Sequence[DraftHead], names: Sequence[str], tree: TreeConfig | None = None):
        self.drafters = list(drafters)
        self.names = list(names)
        self.tree = tree or TreeConfig()
        self.target: TargetModel | None = None
        self.states: list[DrafterState] = []
        self.support = common_support(self.drafters)
        self.feature_layers = union_layers([d.feature_layers for d in self.drafters])

    def start(self, target: TargetModel, tokens: torch.Tensor, features: torch.Tensor) -> None:
        check_drafters(self.drafters, self.names, target)
        self.target = target
        self.states = [DrafterState(d, layers=self.feature_layers) for d in self.drafters]
        for state in self.states:
            state.add(tokens, features)

    def advance(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        for state in self.states:
            state.add(tokens, features)

    def draft(self, i: int, state: DecodeState) -> DraftTree:
        if self.target is None:
            raise RuntimeError(f"strategy over {self.names}: start() it on a request before propose()")
        return draft_tree(self.drafters[i], self.target, self.states[i], state.tree(self.tree), self.support)


class RoutedStrategy(_Ensemble):
    """Verify one drafter's tree per step, chosen by ``signal`` at ``granularity`` (see the module doc)."""

    def __init__(self, drafters: Sequence[DraftHead], names: Sequence[str], tree: TreeConfig | None = None,
                 signal: str = "confidence", granularity: str = "step", probe_steps: int = 2,
                 recheck_every: int = 0):
        super().__init__(drafters, names, tree)
        if signal not in SIGNALS or granularity not in GRANULARITIES:
            raise ValueError(f"routing needs signal in {SIGNALS} and granularity in {GRANULARITIES}, "
                             f"got {signal!r}, {granularity!r}")
        if probe_steps < 1 or recheck_every < 0:
            raise ValueError(f"probe_steps must be >= 1 and recheck_every >= 0, got {probe_steps}, {recheck_every}")
        self.signal, self.granularity = signal, granularity
        self.probe_steps, self.recheck_every = probe_steps, recheck_every
        self.spec = StrategySpec("routed", signal=signal, granularity=granularity)
        self.name = self.spec.name
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.route = RequestRoute(self.signal, self.probe_steps, self.recheck_every) \
            if self.granularity == "request" else None

    def start(self, target: TargetModel, tokens: torch.Tensor, features: torch.Tensor) -> None:
        super().start(target, tokens, features)
        self._reset()

    def probing(self, step: int) -> bool:
        """Whether step ``step`` (0-based within the request) drafts with every drafter."""
        return self.route is None or self.route.probing(step)

    def propose(self, state: DecodeState) -> DraftTree:
        probe = self.probing(self.steps)
        self.steps += 1
        chosen = None if probe or self.route is None else self.route.choice
        trees: list[DraftTree | None] = [self.draft(i, state) if chosen is None or i == chosen else None
                                         for i in range(len(self.drafters))]
        tree, meta = compose_trees(self.spec, trees, self.names, self.tree.total_tokens)
        if probe and self.route is not None:
            self.route.observe(meta["signals"])
        tree.meta.update(meta, probe=probe)
        if self.route is not None:
            tree.meta["decision"] = None if self.route.choice is None else self.names[self.route.choice]
        return graft_lookup(tree, state.tokens, self.tree)


class MergedStrategy(_Ensemble):
    """Verify the trie union of all K trees; ``budget`` keeps only the root and the N - 1 most confident nodes."""

    def __init__(self, drafters: Sequence[DraftHead], names: Sequence[str], tree: TreeConfig | None = None,
                 budget: bool = False):
        super().__init__(drafters, names, tree)
        self.budget = budget
        self.name = "merged:budget" if budget else "merged:union"

    def propose(self, state: DecodeState) -> DraftTree:
        trees: list[DraftTree | None] = [self.draft(i, state) for i in range(len(self.drafters))]
        spec = StrategySpec("merged", merge="budget" if self.budget else "union")
        merged, meta = compose_trees(spec, trees, self.names, self.tree.total_tokens)
        merged.meta.update(meta)
        return graft_lookup(merged, state.tokens, self.tree)


def averaging_weights(spec: StrategySpec, k: int, weights: Sequence[float] | None) -> list[float]:
    if weights is not None:
        if spec.alpha is not None:
            raise ValueError(f"strategy {spec.name!r} fixes alpha; do not pass weights as well")
        weights = [float(w) for w in weights]
        if len(weights) != k:
            raise ValueError(f"averaging needs one weight per drafter: {k} drafters, {len(weights)} weights")
        if any(not 0.0 <= w <= 1.0 for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
            raise ValueError(f"averaging weights must be in [0, 1] and sum to 1, got {weights} (sum {sum(weights):g})")
        return weights
    if spec.alpha is not None:
        if k != 2:
            raise ValueError(f"strategy {spec.name!r} interpolates two drafters, got {k}; "
                             "use 'averaged' (uniform) or pass weights")
        return [spec.alpha, 1.0 - spec.alpha]
    return [1.0 / k] * k


def build_strategy(
    spec: str | StrategySpec,
    drafters: Sequence[DraftHead] | Mapping[str, DraftHead] = (),
    tree_cfg: TreeConfig | None = None,
    *,
    names: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
    probe_steps: int = 2,
    recheck_every: int = 0,
) -> Strategy:
    """A ready :class:`~taps_ray.spec.protocol.Strategy` for ``spec`` over ``drafters``.

    ``drafters`` is a list (named by ``names``, else their metadata ``name``, else ``d0, d1, ..``) or a
    name -> drafter mapping, in routing / merge order; ``single:NAME`` picks one by name, ``single``
    the first. A drafting strategy carries a fresh :class:`~taps_ray.spec.cost.TreeBudget` as ``tree_budget``
    (each step's tree sized by the cost model) unless ``tree_cfg.adaptive`` is off. ``weights`` [K] override the uniform average of ``averaged``; ``probe_steps`` and
    ``recheck_every`` set ``request`` routing. :class:`~taps_ray.spec.strategy.StrategyError` (a ValueError)
    for drafters that do not fit the strategy (:meth:`~taps_ray.spec.strategy.StrategySpec.bind`), ValueError
    for drafters of different targets or alpha or weights out of range.
    """
    spec = parse_strategy(spec)
    if isinstance(drafters, Mapping):
        names, heads = list(drafters), list(drafters.values())
    else:
        heads = list(drafters)
        names = list(names) if names is not None else [h.metadata.get("name") or f"d{i}" for i, h in enumerate(heads)]
    if len(names) != len(heads) or len(set(names)) != len(names):
        raise ValueError(f"need one distinct name per drafter, got {names} for {len(heads)} drafters")
    if spec.kind == "vanilla":
        return VanillaStrategy()
    bound = spec.bind(names)
    check_drafters(heads, names)
    if spec.kind == "single":
        strategy: SingleStrategy | RoutedStrategy | MergedStrategy = SingleStrategy(heads[names.index(bound[0])],
                                                                                    tree_cfg)
    elif spec.kind == "averaged":
        strategy = SingleStrategy(average_drafters(heads, averaging_weights(spec, len(heads), weights)), tree_cfg)
    elif spec.kind == "routed":
        strategy = RoutedStrategy(heads, names, tree_cfg, spec.signal or "confidence", spec.granularity or "step",
                                  probe_steps, recheck_every)
    else:
        strategy = MergedStrategy(heads, names, tree_cfg, budget=spec.merge == "budget")
    if isinstance(strategy, SingleStrategy):
        strategy.name = spec.name
    if tree_cfg is None or tree_cfg.adaptive:
        strategy.tree_budget = TreeBudget()
    return strategy
