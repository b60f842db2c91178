"""Draft trees: the :class:`DraftTree` container, EAGLE-2 dynamic expansion and rerank, trie union.

Shapes: ``N`` tree nodes including the root (node 0), ``K`` = ``top_k``, ``D`` = ``depth``
(expansions after the first level), ``H`` hidden size, ``V`` draft vocabulary, ``r`` = the prefix
length (number of target KV entries before the root; the root sits at position ``r``).

Every tree keeps its nodes in an order where parents precede children (``parent[i] < i``), so any
index prefix ``0..n-1`` is itself a tree and level-by-level loops never need per-node Python work.
Siblings carry distinct tokens (:func:`check_distinct_siblings`): the lossless T>0 acceptance rule
(:func:`taps_ray.spec.verify.verify_sampling`) assumes it; recursive rejection over children ``b, c, c``
would offer c twice and bias the output at T>0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from taps_ray.config import TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.models.engine import can_pack, read_linears_packed
from taps_ray.models.quant import read_linears_in_half, read_linears_in_q8
from taps_ray.models.target import TargetModel, layer_columns
from taps_ray.models.target_cache import crop_cache
from taps_ray.spec.draft_compute import (
    DIRECT,
    DraftCompute,
    DraftHeadProduct,
    draft_head_kind,
    draft_head_rows,
)


@dataclass
class DraftTree:
    """A token tree rooted at the last target token, ready for verification.

    ``tokens`` [N] long (target vocabulary; ``tokens[0]`` is the root), ``parent`` [N] long
    (``-1`` for the root, ``parent[i] < i``), ``depth`` [N] long (root 0), ``score`` [N] float
    (cumulative draft log-prob of the path, root 0, non-increasing along paths), ``entropy`` [N]
    float (entropy of the draft distribution the node was drawn from, root 0), ``mask`` [N, N]
    bool (``mask[i, j]``: j is i or an ancestor of i), ``prefix_len`` r. ``meta`` carries
    strategy information (routing decisions, merge sources) into the step record. ``support``
    [S] long, sorted: the target ids over which ``score`` and ``entropy`` are normalised (a draft
    vocabulary or a common support, see :func:`draft_tree`); None: the whole target vocabulary, or no
    single support (trees built by hand, merged from trees over different supports). Scores and
    entropies of two trees are comparable only over the same support (:func:`same_support`).
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    prefix_len: int
    meta: dict = field(default_factory=dict)
    support: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def positions(self) -> torch.Tensor:
        """Position ids [N] = prefix_len + depth."""
        return self.depth + self.prefix_len

    @cached_property
    def paths(self) -> torch.Tensor:
        """Root-to-leaf node indices [L, max_depth + 1], padded with -1, one row per leaf (ascending)."""
        has_child = torch.zeros(self.size, dtype=torch.bool, device=self.tokens.device)
        has_child[self.parent[1:]] = True
        leaves = (~has_child).nonzero().squeeze(1)
        rows = self.mask[leaves]
        column = rows.long().cumsum(1) - 1
        leaf_row, node = rows.nonzero(as_tuple=True)
        out = torch.full((leaves.numel(), int(self.depth.max()) + 1), -1, dtype=torch.long, device=rows.device)
        out[leaf_row, column[leaf_row, node]] = node
        return out

    def select(self, keep: torch.Tensor) -> DraftTree:
        """The subtree on node indices ``keep`` [n] (ascending, contains 0, closed under ancestors);
        ``meta["lookup_nodes"]`` counts the prompt-lookup nodes kept (they stay last)."""
        keep = keep.to(torch.long)
        remap = torch.full((self.size + 1,), -1, dtype=torch.long, device=keep.device)
        remap[keep] = torch.arange(keep.numel(), device=keep.device)
        meta = dict(self.meta)
        if meta.get("lookup_nodes"):
            meta["lookup_nodes"] = int((keep >= self.size - int(meta["lookup_nodes"])).sum())
        return DraftTree(
            tokens=self.tokens[keep],
            parent=remap[self.parent[keep]],
            depth=self.depth[keep],
            score=self.score[keep],
            entropy=self.entropy[keep],
            mask=self.mask[keep][:, keep],
            prefix_len=self.prefix_len,
            meta=meta,
            support=self.support,
        )

    def top_nodes(self, n: int) -> torch.Tensor:
        """Node indices [min(n, N)], ascending: the root plus the ``n - 1`` best-scored nodes
        (ancestor-closed, since scores do not increase along paths and parents come first)."""
        return torch.cat([self.tokens.new_zeros(1), 1 + rerank(self.score[1:], n - 1)])

    def top(self, n: int) -> DraftTree:
        """The subtree on :meth:`top_nodes` (this tree when it has at most ``n`` nodes)."""
        return self if n >= self.size else self.select(self.top_nodes(n))

    def to(self, device: torch.device | str) -> DraftTree:
        """This tree with its tensors on ``device`` (this tree when already there; ``meta`` is shared)."""
        device = torch.device(device)
        if self.tokens.device == device:
            return self
        return DraftTree(self.tokens.to(device), self.parent.to(device), self.depth.to(device),
                         self.score.to(device), self.entropy.to(device), self.mask.to(device), self.prefix_len,
                         self.meta, self.support)


def same_support(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two :attr:`DraftTree.support` values name the same target ids."""
    if a is None or b is None:
        return a is b
    return a is b or (a.shape == b.shape and torch.equal(a, b.to(a.device)))


def rerank(score: torch.Tensor, n: int) -> torch.Tensor:
    """Indices [min(n, M)] of the best of ``score`` [M], returned ascending.

    Candidates must be listed parents first with child score <= parent score; the stable sort then
    breaks ties by index, so a kept node's parent always ranks ahead of it and is kept too.
    """
    order = torch.sort(score, descending=True, stable=True).indices[:n]
    return order.sort().values


_KEY_SPAN = 1 << 32  # (parent, token) -> parent * span + token is injective for token ids in [0, 2**32)


def repeated_siblings(tokens: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """0-dim bool: whether two children of one node carry the same token.

    ``tokens`` [N], ``parent`` [N] long (as in :class:`DraftTree`). One sort of N keys, no host sync.
    """
    key = (parent * _KEY_SPAN + tokens).sort().values
    return (key[1:] == key[:-1]).any()


def check_distinct_siblings(tokens: torch.Tensor, parent: torch.Tensor) -> None:
    """ValueError naming two sibling nodes that carry the same token (see :func:`repeated_siblings`)."""
    key, order = (parent * _KEY_SPAN + tokens).sort()
    same = key[1:] == key[:-1]
    if bool(same.any()):
        at = int(same.to(torch.uint8).argmax())
        a, b = sorted((int(order[at]), int(order[at + 1])))
        raise ValueError(f"siblings must carry distinct tokens: nodes {a} and {b} (children of node "
                         f"{int(parent[a])}) both carry token {int(tokens[a])}")


def ancestor_mask(parent: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """``mask`` [N, N] bool from ``parent`` [N] (``-1`` for the root).

    Follows parent links ``max_depth`` times (the tree's depth; until every chain ends when None).
    """
    n = parent.numel()
    rows = torch.arange(n, device=parent.device)
    mask = torch.eye(n, dtype=torch.bool, device=parent.device)
    hop = parent.clone()
    safe = torch.cat([parent, parent.new_full((1,), -1)])
    hops = 0
    while (hops < max_depth) if max_depth is not None else bool((hop >= 0).any()):
        mask[rows, hop.clamp(min=0)] |= hop >= 0
        hop = safe[hop]
        hops += 1
    return mask


def build_tree(
    tokens: torch.Tensor | list[int],
    parents: torch.Tensor | list[int],
    score: torch.Tensor | list[float] | None = None,
    entropy: torch.Tensor | list[float] | None = None,
    prefix_len: int = 0,
    meta: dict | None = None,
) -> DraftTree:
    """A :class:`DraftTree` from node ``tokens`` [N] and ``parents`` [N] (``parents[0] == -1``,
    ``parents[i] < i``, siblings with distinct tokens; ValueError naming the first node that breaks a
    rule). ``score`` defaults to ``-depth`` (shallower first), ``entropy`` to 0.
    """
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    parent = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
    n = tokens.numel()
    if n < 1 or parent.shape != tokens.shape:
        raise ValueError(f"need tokens and parents of the same length >= 1, got {tuple(tokens.shape)} and "
                         f"{tuple(parent.shape)}")
    if int(parent[0]) != -1:
        raise ValueError(f"node 0 must be the root (parent -1), got parent {int(parent[0])}")
    bad = (parent[1:] < 0) | (parent[1:] >= torch.arange(1, n, device=parent.device))
    if bad.any():
        i = int(bad.nonzero()[0]) + 1
        raise ValueError(f"parents must precede children: node {i} has parent {int(parent[i])}")
    check_distinct_siblings(tokens, parent)
    mask = ancestor_mask(parent)
    depth = mask.sum(1) - 1
    device = tokens.device
    score = -depth.float() if score is None else torch.as_tensor(score, dtype=torch.float32, device=device)
    entropy = torch.zeros(n, device=device) if entropy is None else torch.as_tensor(entropy, dtype=torch.float32,
                                                                                    device=device)
    return DraftTree(tokens, parent, depth, score, entropy, mask, prefix_len, dict(meta or {}))


def merge_trees(trees: list[DraftTree]) -> DraftTree:
    """Trie union of trees drafted from the same prefix: identical root-to-node paths become one node.

    A merged node's ``score`` is the best of its copies, ``entropy`` their mean;
    ``meta["sources"]`` [N, len(trees)] bool says which trees proposed each node. Nodes come out
    level by level (parents first), so :meth:`DraftTree.top` gives the budgeted merge. The union keeps
    the trees' common ``support`` (None when they differ: its scores are then not comparable).
    """
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    if len({t.prefix_len for t in trees}) != 1 or len({int(t.tokens[0]) for t in trees}) != 1:
        raise ValueError("trees must share the prefix and the root token to be merged")
    device = trees[0].tokens.device
    sizes = [t.size for t in trees]
    offsets = [sum(sizes[:i]) for i in range(len(trees))]
    tokens = torch.cat([t.tokens for t in trees])
    parent = torch.cat([torch.where(t.parent >= 0, t.parent + o, -1) for t, o in zip(trees, offsets)])
    depth = torch.cat([t.depth for t in trees])
    source = torch.repeat_interleave(torch.arange(len(trees), device=device), torch.tensor(sizes, device=device))
    merged = torch.full_like(tokens, -1)
    merged[depth == 0] = 0
    next_id = 1
    for level in range(1, int(depth.max()) + 1):
        nodes = (depth == level).nonzero().squeeze(1)
        keys = torch.stack([merged[parent[nodes]], tokens[nodes]], dim=1)
        unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
        merged[nodes] = next_id + inverse
        next_id += unique.shape[0]
    m_parent = torch.full((next_id,), -1, dtype=torch.long, device=device)
    m_parent[merged] = torch.where(parent >= 0, merged[parent.clamp(min=0)], -1)
    m_tokens = torch.zeros(next_id, dtype=torch.long, device=device).scatter(0, merged, tokens)
    scores = torch.cat([t.score for t in trees]).float()
    m_score = torch.full((next_id,), -torch.inf, device=device).scatter_reduce(0, merged, scores, "amax")
    m_entropy = torch.zeros(next_id, device=device).scatter_reduce(
        0, merged, torch.cat([t.entropy for t in trees]).float(), "mean", include_self=False)
    sources = torch.zeros(next_id, len(trees), dtype=torch.bool, device=device)
    sources[merged, source] = True
    union = build_tree(m_tokens, m_parent, m_score, m_entropy, trees[0].prefix_len, {"sources": sources})
    if all(same_support(t.support, trees[0].support) for t in trees[1:]):
        union.support = trees[0].support
    return union


class DrafterState:
    """A drafter's KV cache over committed ``(token_{i+1}, f_i)`` pairs plus pairs not yet run.

    The cache holds positions ``0 .. committed - 1``; :meth:`add` queues new pairs (tokens [m],
    target features [m, F] laid out as ``layers``: the target hidden states the strategy's forwards return,
    None for the last one alone); each pair keeps the drafter's own :attr:`DraftHead.feature_layers` of them.
    :func:`draft_tree` runs the queued pairs first, so after drafting ``committed`` equals the root's
    position. ``compute`` runs the drafter (:class:`DraftCompute`). ValueError when ``layers`` lacks a layer
    the drafter reads, or :meth:`add` is given features of another width.
    """

    def __init__(self, drafter: DraftHead, compute: DraftCompute = DIRECT, layers: tuple[int, ...] | None = None):
        self.drafter = drafter
        self.compute = compute
        have = tuple(layers) if layers is not None else (drafter.target_layers,)
        want = drafter.feature_layers
        self.layers, self.width = have, len(have) * drafter.config.hidden_size
        self.columns = None if have == want else layer_columns(have, want, drafter.config.hidden_size)
        self.cache = drafter.new_cache()
        self.committed = 0
        self.head: DraftHeadProduct | None = None
        self._tokens: list[torch.Tensor] = []
        self._features: list[torch.Tensor] = []
        self._support: tuple | None = None

    def add(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """Queue pairs: ``tokens`` [m] are token_{i+1}, ``features`` [m, F] are the target's f_i."""
        features = features.reshape(tokens.numel(), -1)
        if features.shape[1] != self.width:
            raise ValueError(f"features of width {features.shape[1]} for a drafter state over target hidden states "
                             f"{list(self.layers)} (width {self.width}): the strategy's feature_layers must name the "
                             f"layers its features hold")
        if self.columns is not None:
            if self.columns.device != features.device:
                self.columns = self.columns.to(features.device)
            features = features[:, self.columns]
        self._tokens.append(tokens.reshape(-1))
        self._features.append(features)

    def support_rows(self, target: TargetModel, support: torch.Tensor | None) -> tuple[torch.Tensor | None,
                                                                                      torch.Tensor | None]:
        """``(recorded, extra)`` for drafting over ``support`` (sorted target ids [S] containing the draft
        vocabulary; None: the draft vocabulary): the tree's ``support`` (None for the whole target
        vocabulary) and the LM-head rows [E, H] of the support ids outside the draft vocabulary (None
        when there are none). Computed once per support; ValueError when ``support`` misses a draft id."""
        if self._support is not None and self._support[0] is support:
            return self._support[1:]
        own = self.drafter.draft_to_target
        vocab = target.vocab_size
        if support is None:
            recorded = None if own is None else own.sort().values
            extra = None
        else:
            ids = support.to(device=target.device, dtype=torch.long)
            own = torch.arange(vocab, device=ids.device) if own is None else own.to(ids.device)
            missing = int((~torch.isin(own, ids)).sum())
            if missing:
                raise ValueError(f"a support of {ids.numel()} target ids misses {missing} of the drafter's "
                                 f"{own.numel()} draft ids")
            recorded = None if ids.numel() == vocab else ids
            outside = ids[~torch.isin(ids, own)]
            extra = target.lm_head.weight[outside] if outside.numel() else None
        self._support = (support, recorded, extra)
        return recorded, extra

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._tokens:
            raise RuntimeError("drafter state has no new pairs: call add() with the accepted tokens first")
        tokens, features = torch.cat(self._tokens), torch.cat(self._features)
        self._tokens, self._features = [], []
        return tokens, features


def _widen(extra: torch.Tensor, hidden: torch.Tensor, lse: torch.Tensor,
           entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-normalise draft distributions from their draft vocabulary S onto S plus ``extra`` LM-head rows
    [E, H]: for drafter outputs ``hidden`` [n, H] with log-normalisers ``lse`` [n] and entropies
    ``entropy`` [n] over S, returns the log-prob shift [n] (log p_support - log p_S of any token of S,
    <= 0) and the entropies [n] over the support."""
    w = (extra @ hidden.to(extra.dtype).T).T.float() - lse[:, None]
    shift = -torch.nn.functional.softplus(w.logsumexp(-1))
    logp_extra = w + shift[:, None]
    widened = shift.exp() * (entropy - shift) - (logp_extra.exp() * logp_extra).sum(-1)
    return shift, widened


@torch.inference_mode()
def draft_tree(drafter: DraftHead, target: TargetModel, state: DrafterState, tree_cfg: TreeConfig,
               support: torch.Tensor | None = None) -> DraftTree:
    """Draft one EAGLE-2 dynamic tree of at most ``tree_cfg.total_tokens`` nodes.

    Runs the queued pairs (the last token queued is the root), takes the root's top-K children,
    then ``depth`` times runs the drafter on the K frontier nodes at once under a tree mask over
    its own cache, scores all K*K children by cumulative log-prob and keeps the global top K as
    the next frontier. Rerank keeps the ``total_tokens - 1`` best of every generated node. The
    expansion KV entries are cropped afterwards; only the committed pairs stay in the cache.
    Siblings are distinct without a check: each node's children are one top-K over the draft
    vocabulary, and ``draft_to_target`` is injective (checked when the :class:`DraftHead` is built).

    ``support`` (sorted target ids [S] containing the draft vocabulary; None: the draft vocabulary):
    the tree's ``score`` and ``entropy`` are those of the drafter's distributions re-normalised over
    these target ids (one more LM-head product, over the ids outside the draft vocabulary, per tree),
    so trees of drafters with different draft vocabularies drafted over one support compare. The
    tree's nodes are chosen on the draft vocabulary either way.
    """
    recorded, extra = state.support_rows(target, support)
    out, root, r, head = _commit_pending(drafter, target, state)
    candidates = _expand(drafter, target, state, head, out, r, tree_cfg, rows=extra is not None)
    crop_cache(state.cache, r)
    return _assemble(candidates, root, r, tree_cfg, extra, recorded)


@dataclass
class _Candidates:
    """Every node the expansion generated, in generation order (the root's top-K children, then K*K
    children per level): token, parent index (-1: the root), cumulative log-prob, the entropy of the
    distribution it was drawn from, depth, and (with a support) the row of that distribution in
    ``rows`` (hidden, log-sum-exp, entropy per drafter call)."""

    token: torch.Tensor
    parent: torch.Tensor
    score: torch.Tensor
    entropy: torch.Tensor
    depth: torch.Tensor
    row: torch.Tensor | None
    rows: list | None


def _commit_pending(drafter: DraftHead, target: TargetModel,
                    state: DrafterState) -> tuple[torch.Tensor, torch.Tensor, int, DraftHeadProduct]:
    """Run the queued pairs into the drafter's cache: (the drafter's output [1, P, H], the root token [1],
    the committed length, the draft LM head)."""
    device = target.device
    tokens, features = state.take_pending()
    r = state.committed + tokens.numel()
    positions = torch.arange(state.committed, r, device=device)[None]
    dtype = drafter.fc.weight.dtype
    out = state.compute.forward(drafter, target.embed_tokens(tokens.to(device))[None],
                                drafter.fuse(features[None].to(device, dtype)), positions, state.cache, None)
    state.committed = r
    if state.head is None:
        kind = draft_head_kind(target)
        state.head = draft_head_rows(drafter, target.lm_head.weight, kind)
        if kind == "half":
            read_linears_in_half(drafter)
        elif kind == "q4q8":
            read_linears_in_q8(drafter)
        elif can_pack(drafter.fc.weight.device, drafter.fc.weight.dtype):
            read_linears_packed(drafter)
    return out, tokens[-1:], r, state.head


def _expand(drafter: DraftHead, target: TargetModel, state: DrafterState, head: DraftHeadProduct,
            out: torch.Tensor, r: int,
            tree_cfg: TreeConfig, rows: bool) -> _Candidates:
    """The root's top-K children, then ``depth`` levels: the drafter on the K frontier nodes at once
    (tree mask over its own cache), all K*K children scored, the global top K the next frontier."""
    device = target.device
    dtype = drafter.fc.weight.dtype
    logp, ent, lse = state.compute.log_probs(head, drafter.readout(out[0, -1:]))
    k = min(tree_cfg.top_k, logp.shape[-1])
    depth = tree_cfg.depth
    n_cand = k + depth * k * k
    c = _Candidates(token=torch.empty(n_cand, dtype=torch.long, device=device),
                    parent=torch.empty(n_cand, dtype=torch.long, device=device),
                    score=torch.empty(n_cand, dtype=torch.float32, device=device),
                    entropy=torch.empty(n_cand, dtype=torch.float32, device=device),
                    depth=torch.empty(n_cand, dtype=torch.long, device=device),
                    row=torch.zeros(n_cand, dtype=torch.long, device=device) if rows else None,
                    rows=[(drafter.readout(out[0, -1:]), lse, ent)] if rows else None)

    top = logp[0].topk(k)
    frontier_token = drafter.to_target_ids(top.indices)
    frontier_score = top.values
    frontier_id = torch.arange(k, device=device)
    c.token[:k], c.parent[:k], c.score[:k] = frontier_token, -1, frontier_score
    c.entropy[:k], c.depth[:k] = ent[0], 1
    frontier_feature = out[0, -1:].expand(k, -1)
    slot_ancestors = torch.zeros(k, 0, dtype=torch.bool, device=device)
    eye = torch.eye(k, dtype=torch.bool, device=device)
    filled = k

    for level in range(1, depth + 1):
        slot_ancestors = torch.cat([slot_ancestors, eye], dim=1)
        allowed = torch.cat([slot_ancestors.new_ones(k, r), slot_ancestors], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        positions = torch.full((1, k), r + level - 1, device=device)
        hidden = state.compute.forward(drafter, target.embed_tokens(frontier_token)[None], frontier_feature[None],
                                       positions, state.cache, mask)[0]
        readout = drafter.readout(hidden)
        logp, ent, lse = state.compute.log_probs(head, readout)
        if c.rows is not None:
            c.rows.append((readout, lse, ent))
        top = logp.topk(k, dim=-1)
        child_score = (frontier_score[:, None] + top.values).reshape(-1)
        child_token = drafter.to_target_ids(top.indices).reshape(-1)
        span = slice(filled, filled + k * k)
        c.token[span], c.score[span] = child_token, child_score
        c.parent[span] = frontier_id.repeat_interleave(k)
        c.entropy[span], c.depth[span] = ent.repeat_interleave(k), level + 1
        if c.row is not None:
            c.row[span] = 1 + (level - 1) * k + torch.arange(k, device=device).repeat_interleave(k)
        if level < depth:
            best = child_score.topk(k).indices
            row = best // k
            frontier_token, frontier_score = child_token[best], child_score[best]
            frontier_id = filled + best
            frontier_feature = hidden[row]
            slot_ancestors = slot_ancestors[row]
        filled += k * k
    return c


def _assemble(c: _Candidates, root: torch.Tensor, r: int, tree_cfg: TreeConfig, extra,
              recorded) -> DraftTree:
    """Rerank: the ``total_tokens - 1`` best candidates under the root, as a :class:`DraftTree` (scores and
    entropies re-normalised over the support when there is one)."""
    device = c.token.device
    keep = rerank(c.score, tree_cfg.total_tokens - 1)
    remap = torch.full((c.token.numel() + 1,), -1, dtype=torch.long, device=device)
    remap[keep] = torch.arange(1, keep.numel() + 1, device=device)
    parent = torch.cat([torch.full((1,), -1, device=device), remap[c.parent[keep]].clamp(min=0)])
    mask = ancestor_mask(parent, tree_cfg.depth + 1)
    score = torch.cat([c.score.new_zeros(1), c.score[keep]])
    entropy = torch.cat([c.entropy.new_zeros(1), c.entropy[keep]])
    if c.rows is not None and c.row is not None:
        hidden, lse, ent = (torch.cat(part) for part in zip(*c.rows))
        shift, widened = _widen(extra, hidden, lse, ent)
        node_row = c.row[keep]
        score = score + mask.float() @ torch.cat([shift.new_zeros(1), shift[node_row]])
        entropy = torch.cat([entropy.new_zeros(1), widened[node_row]])
    return DraftTree(
        tokens=torch.cat([root.to(device), c.token[keep]]),
        parent=parent,
        depth=torch.cat([c.depth.new_zeros(1), c.depth[keep]]),
        score=score,
        entropy=entropy,
        mask=mask,
        prefix_len=r,
        support=recorded,
    )
