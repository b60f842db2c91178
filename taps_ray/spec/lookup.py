"""Prompt lookup grafted onto a draft tree: a free chain of tokens copied from the context.

Answers repeat their context (numbers and names of a math question, code, quoted text), and the
target then continues a span it has already seen. :func:`lookup_continuation` finds the most
recent earlier occurrence of the context's last ``n`` tokens (``n`` from ``max_ngram`` down to
``min_ngram``) and returns the tokens that followed it; :func:`graft_lookup` adds that chain to a
drafter's tree under the root, sharing the nodes the tree already has. Drafting it costs no model
pass, verification sees at most ``max_tokens`` more nodes, and only in steps with a match.

Shapes: ``L`` context length (prompt + generated, the root last), ``N`` tree nodes, ``m`` chain length.
"""

from __future__ import annotations

import math
from typing import overload

import torch

from taps_ray.config import TreeConfig
from taps_ray.spec.tree import DraftTree, build_tree

LOOKUP_LOGP = math.log(0.5)
"""Nominal draft log-prob per copied token: chain nodes get ``score`` = the score of the tree node they
hang from plus this per step, so ``score`` stays non-increasing along every path."""


def lookup_continuation(tokens: torch.Tensor, max_ngram: int, min_ngram: int, max_tokens: int) -> torch.Tensor:
    """The tokens [m <= max_tokens] that followed the latest earlier occurrence of the last ``n`` tokens
    of ``tokens`` [L], for the largest ``n`` in ``max_ngram .. min_ngram`` that occurs; empty if none."""
    length = tokens.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = tokens.unfold(0, n, 1)[:-1]
        hits = (windows == tokens[length - n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start:start + max_tokens]
    return tokens[:0]


def graft_chain(tree: DraftTree, chain: torch.Tensor) -> DraftTree:
    """``tree`` with the path root -> ``chain`` [m] added: the longest prefix of the chain that is already
    a root path of the tree is shared, the rest becomes new nodes (appended, parents first).

    Siblings stay distinct (a new node's parent had no child with its token, or the prefix would be
    longer). Returns ``tree`` itself when nothing is added.
    """
    if chain.numel() == 0:
        return tree
    chain = chain.to(tree.tokens.device)
    depth = tree.depth
    on_level = (depth >= 1) & (depth <= chain.numel())
    match = torch.zeros_like(on_level)
    match[on_level] = tree.tokens[on_level] == chain[depth[on_level] - 1]
    match[0] = True
    on_chain = ~(tree.mask & ~match[None]).any(dim=1)
    last = int((depth * on_chain).argmax())
    shared = int(depth[last])
    rest = chain[shared:]
    if rest.numel() == 0:
        return tree
    n, m = tree.size, rest.numel()
    new_ids = torch.arange(n, n + m, device=rest.device)
    parent = torch.cat([tree.parent, torch.cat([new_ids.new_tensor([last]), new_ids[:-1]])])
    steps = torch.arange(1, m + 1, device=rest.device)
    mask = torch.zeros(n + m, n + m, dtype=torch.bool, device=rest.device)
    mask[:n, :n] = tree.mask
    mask[n:, :n] = tree.mask[last]
    mask[n:, n:] = torch.ones(m, m, dtype=torch.bool, device=rest.device).tril()
    return DraftTree(
        tokens=torch.cat([tree.tokens, rest]),
        parent=parent,
        depth=torch.cat([depth, shared + steps]),
        score=torch.cat([tree.score, tree.score[last] + LOOKUP_LOGP * steps.to(tree.score.dtype)]),
        entropy=torch.cat([tree.entropy, tree.entropy.new_zeros(m)]),
        mask=mask,
        prefix_len=tree.prefix_len,
        meta={**tree.meta, "lookup_nodes": m},
        support=tree.support,
    )


@overload
def graft_lookup(tree: DraftTree, tokens: torch.Tensor, cfg: TreeConfig) -> DraftTree: ...


@overload
def graft_lookup(tree: None, tokens: torch.Tensor, cfg: TreeConfig) -> DraftTree | None: ...


def graft_lookup(tree: DraftTree | None, tokens: torch.Tensor, cfg: TreeConfig) -> DraftTree | None:
    """``tree`` plus the prompt-lookup chain of context ``tokens`` [L] (``cfg.lookup_tokens`` 0: unchanged).

    Without a tree (no drafter answered this step) the chain alone is the tree, rooted at
    ``tokens[-1]``; with no chain either, None (the step decodes plainly).
    """
    if cfg.lookup_tokens == 0:
        return tree
    chain = lookup_continuation(tokens, cfg.lookup_ngram, cfg.lookup_min_ngram, cfg.lookup_tokens)
    if tree is None:
        if chain.numel() == 0:
            return None
        m = chain.numel()
        return build_tree(torch.cat([tokens[-1:], chain]), torch.arange(-1, m), LOOKUP_LOGP * torch.arange(m + 1.0),
                          prefix_len=tokens.numel() - 1, meta={"lookup_nodes": m})
    return graft_chain(tree, chain)
