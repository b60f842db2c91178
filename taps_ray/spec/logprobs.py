"""Per-token log-probabilities of the emitted tokens, from logits the target already computed.

Convention: the target's *raw* distribution, ``log_softmax`` of its logits at each position in
float32, before temperature, top-k and top-p (as the OpenAI API reports the model's logprobs and
vLLM's default ``raw_logprobs`` does). They do not depend on the sampling parameters, so greedy
(T = 0) requests get a meaningful distribution, and a speculative run reports what vanilla decoding
would at the same positions.

Shapes: ``n`` emitted tokens, ``V`` target vocabulary, ``k`` alternatives per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """``logprobs`` [n] float32: each emitted token's log-probability; ``top_ids`` [n, k] long and
    ``top_logprobs`` [n, k] float32: the k most likely tokens at its position, most likely first."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def __len__(self) -> int:
        return self.logprobs.numel()

    def __getitem__(self, index: slice) -> TokenLogprobs:
        if not isinstance(index, slice):
            raise TypeError(f"TokenLogprobs takes a slice, got {type(index).__name__}")
        return TokenLogprobs(self.logprobs[index], self.top_ids[index], self.top_logprobs[index])

    def cpu(self) -> TokenLogprobs:
        return TokenLogprobs(self.logprobs.cpu(), self.top_ids.cpu(), self.top_logprobs.cpu())

    @staticmethod
    def cat(parts: list[TokenLogprobs], top: int) -> TokenLogprobs:
        """``parts`` joined in order (an empty list gives n = 0 with ``top`` columns)."""
        if not parts:
            return TokenLogprobs(torch.empty(0), torch.empty(0, top, dtype=torch.long), torch.empty(0, top))
        return TokenLogprobs(torch.cat([p.logprobs for p in parts]), torch.cat([p.top_ids for p in parts]),
                             torch.cat([p.top_logprobs for p in parts]))


def check_top(top: int | None) -> int | None:
    """``top`` (alternatives per token; None: no logprobs) checked: an int in [0, 20], else ValueError."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise ValueError(f"logprobs must be None (off) or an integer in [0, 20] (alternatives per token), got {top!r}")
    return top


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> TokenLogprobs:
    """The raw log-probabilities of ``tokens`` [n] under ``logits`` [n, V] (row i is the distribution
    token i was drawn from) and the ``top`` most likely alternatives per row; no host sync."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens.reshape(-1, 1).to(logp.device)).squeeze(-1)
    values, ids = logp.topk(top, dim=-1)
    return TokenLogprobs(chosen, ids, values)
