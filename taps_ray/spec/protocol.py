"""The :class:`Strategy` protocol the decode loop drives, the :class:`DecodeState` it hands over, and the
two strategies without composition: :class:`VanillaStrategy` (no drafting) and :class:`SingleStrategy`.

Composed strategies (averaged, routed, merged) live in :mod:`taps_ray.spec.compose`; the loop in
:mod:`taps_ray.spec.decoder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from taps_ray.config import TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.models.target import TargetModel
from taps_ray.spec.lookup import graft_lookup
from taps_ray.spec.tree import DrafterState, DraftTree, draft_tree

if TYPE_CHECKING:
    from taps_ray.spec.cost import TreeBudget


@dataclass
class DecodeState:
    """The shared prefix at the start of a step (read-only for strategies).

    ``tokens`` [L] prompt + generated so far; ``tokens[-1]`` is the root (not yet in the target's
    cache), so ``prefix_len == L - 1`` is the root's position; ``step`` counts verifications.
    ``depth``: the deepest node depth to draft this step (1: the root's children only; None: the strategy's
    own tree), set by the loop's tree budget; strategies draft no deeper than it and their tree.
    ``notes``: what the strategy wants kept about this step (who answered, what was skipped); the loop
    puts it in the step record's ``meta``.
    """

    tokens: torch.Tensor
    prefix_len: int
    prompt_len: int
    step: int
    notes: dict = field(default_factory=dict)
    depth: int | None = None

    def tree(self, cfg: TreeConfig) -> TreeConfig:
        """``cfg`` drafting no deeper than :attr:`depth` (:func:`at_depth`)."""
        return at_depth(cfg, self.depth)


def at_depth(cfg: TreeConfig, depth: int | None) -> TreeConfig:
    """``cfg`` drafting no deeper than node depth ``depth`` (None: ``cfg``); ``cfg.depth`` counts expansions
    after the first level, so its deepest nodes are at node depth ``cfg.depth + 1``."""
    if depth is None or depth > cfg.depth:
        return cfg
    return cfg.model_copy(update={"depth": max(depth - 1, 0)})


@runtime_checkable
class Strategy(Protocol):
    """How a step's draft tree is made.

    ``start`` begins a request with the prompt pairs (``tokens`` [T] = token_{i+1}, the last one
    being the root; ``features`` [T, H] = f_i); ``propose`` returns the tree to verify from the
    shared prefix (None: decode one token plainly); ``advance`` hands over the pairs of the
    accepted tokens (``tokens`` [k + 1] accepted + bonus, ``features`` [k + 1, H] target features
    at the root and the accepted nodes).

    A proposed tree must be drafted from ``state.prefix_len`` and its siblings must carry distinct
    tokens; :func:`~taps_ray.spec.decoder.generate` refuses any other tree with a RuntimeError
    naming the strategy.

    A strategy may declare ``feature_layers`` (HF ``hidden_states`` indices, the union of its drafters'
    :attr:`~taps_ray.models.drafter.DraftHead.feature_layers`): ``features`` are then those target hidden
    states concatenated, [T, len * H]; without it they are the last hidden state [T, H].
    """

    name: str

    def start(self, target: TargetModel, tokens: torch.Tensor, features: torch.Tensor) -> None: ...

    def propose(self, state: DecodeState) -> DraftTree | None: ...

    def advance(self, tokens: torch.Tensor, features: torch.Tensor) -> None: ...


class VanillaStrategy:
    """No drafting: one target forward per token."""

    name = "vanilla"

    def start(self, target: TargetModel, tokens: torch.Tensor, features: torch.Tensor) -> None:
        pass

    def propose(self, state: DecodeState) -> None:
        return None

    def advance(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        pass


class SingleStrategy:
    """One drafter, one EAGLE-2 tree per step."""

    name = "single"

    tree_budget: TreeBudget | None = None

    def __init__(self, drafter: DraftHead, tree: TreeConfig | None = None):
        self.drafter = drafter
        self.tree = tree or TreeConfig()
        self.target: TargetModel | None = None
        self.state: DrafterState | None = None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.drafter.feature_layers

    def start(self, target: TargetModel, tokens: torch.Tensor, features: torch.Tensor) -> None:
        self.target = target
        self.state = DrafterState(self.drafter, layers=self.feature_layers)
        self.state.add(tokens, features)

    def _started(self) -> tuple[TargetModel, DrafterState]:
        if self.target is None or self.state is None:
            raise RuntimeError(f"strategy {self.name!r}: start() it on a request before propose() or advance()")
        return self.target, self.state

    def propose(self, state: DecodeState) -> DraftTree:
        target, drafter_state = self._started()
        return graft_lookup(draft_tree(self.drafter, target, drafter_state, state.tree(self.tree)), state.tokens,
                            self.tree)

    def advance(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        self._started()[1].add(tokens, features)
