"""Tree verification: attention inputs, greedy and stochastic acceptance, KV compaction.

Shapes: ``N`` tree nodes (node 0 is the root), ``V`` target vocabulary, ``r`` prefix length (target
KV entries before the root), ``k`` accepted draft tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taps_ray.models.target import TargetModel, TargetOutput
from taps_ray.models.target_cache import TargetCache, compact_cache
from taps_ray.spec.tree import DraftTree


@dataclass
class Verdict:
    """Outcome of verifying one tree.

    ``path`` [k + 1] accepted node indices, root first; ``tokens`` [k + 1] tokens to append (the
    k accepted draft tokens, then the bonus token); ``rejected`` 0-dim long: the first tried
    child at the first failing depth (the best-scored child of the last accepted node), -1 when
    that node is a leaf.
    """

    path: torch.Tensor
    tokens: torch.Tensor
    rejected: torch.Tensor

    @property
    def accepted(self) -> int:
        return self.path.numel() - 1

    @property
    def bonus(self) -> torch.Tensor:
        return self.tokens[-1]


def tree_attention(tree: DraftTree, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, N, r + N] (every node sees the prefix and its ancestors) and positions [1, N]."""
    allowed = torch.cat([tree.mask.new_ones(tree.size, tree.prefix_len), tree.mask], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None], tree.positions[None]


def run_tree(target: TargetModel, tree: DraftTree, cache: TargetCache,
             layers: tuple[int, ...] | None = None) -> TargetOutput:
    """One target forward over the tree on top of ``cache`` (length r, extended by N); ``layers``: the hidden
    states the drafters read (``TargetModel.forward``)."""
    mask, positions = tree_attention(tree, target.dtype)
    return target.forward(tree.tokens[None].to(target.device), positions.to(target.device), cache,
                          mask.to(target.device), layers=layers)


def process_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Sampling distribution [..., V] from ``logits`` [..., V]: temperature, then top-k, then top-p.

    top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one).
    """
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _walk(tree: DraftTree, choice: torch.Tensor) -> Verdict:
    """Accept the path along which every node's token equals ``choice`` [N] at its parent.

    Siblings carry distinct tokens, so the accepted nodes form one root path; its deepest node
    ends it and ``choice`` there is the bonus token.
    """
    matches = tree.tokens == choice[tree.parent.clamp(min=0)]
    matches[0] = True
    on_path = ~(tree.mask & ~matches[None]).any(dim=1)
    last = (tree.depth * on_path).argmax()
    path = tree.mask[last].nonzero().squeeze(1)
    tokens = torch.cat([tree.tokens[path[1:]], choice[last][None]])
    child_score = tree.score.masked_fill(tree.parent != last, -torch.inf)
    best = child_score.argmax()
    rejected = torch.where(tree.parent[best] == last, best, -1)
    return Verdict(path=path, tokens=tokens, rejected=rejected)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Greedy acceptance (T = 0) given target ``logits`` [N, V] at the tree nodes.

    From the root, accept the child equal to the target's argmax at its parent; the bonus is the
    argmax after the last accepted node. Equals plain greedy decoding token for token.
    """
    return _walk(tree, logits.argmax(dim=-1))


def verify_sampling(
    tree: DraftTree,
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Multi-draft recursive rejection with deterministic drafts (T > 0), lossless.

    At a node with target distribution p (processors applied) and children x_1..x_m in score
    order, the scheme accepts x_j with probability p(x_j) / (1 - p(x_1) - ... - p(x_{j-1})) after
    x_1..x_{j-1} were rejected, and otherwise samples the bonus from p with the children zeroed.
    Unrolled, x_j is accepted with probability exactly p(x_j) and the bonus is drawn from the
    residual: the same law as one draw y ~ p that is accepted if it is a child and is the bonus
    otherwise. One draw per node (all N in one batched call) therefore realises the scheme; at an
    accepted leaf the draw is the bonus from p at the leaf.
    """
    probs = process_logits(logits, temperature, top_p, top_k)
    choice = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return _walk(tree, choice)


def compact_target(cache: TargetCache, tree: DraftTree, verdict: Verdict) -> None:
    """Keep the prefix and the accepted path's KV entries (in path order), drop the rest of the tree."""
    compact_cache(cache, tree.prefix_len, verdict.path)
