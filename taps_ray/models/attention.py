"""Grouped-query attention without copying the KV cache, for masked multi-token forwards on CPU.

transformers' ``sdpa`` path repeats every layer's K/V heads to the query head count
(``repeat_kv``) whenever a forward has a mask and more than one query, i.e. on every tree
verification and every drafter step: a copy of the whole cache per layer per step. torch's CPU
SDPA kernels take grouped K/V directly (``enable_gqa=True``) with an additive mask, with the
same result. :data:`GQA_SDPA` is that attention, registered with transformers under its own name
and the ``sdpa`` mask format; :func:`use_gqa_sdpa` switches a CPU model to it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

GQA_SDPA = "taps_sdpa_gqa"


def gqa_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``query`` [B, heads, n, d], ``key``/``value`` [B, kv_heads, P + n, d], additive ``attention_mask``
    [B, 1, n, P + n] -> output [B, n, heads, d]. Masked multi-query calls use ``enable_gqa``; every
    other call, and any with soft-capping, attention sinks or a position bias, is transformers' own
    ``sdpa`` (which refuses soft-capping). ``scaling`` is the model's; sliding windows are in the mask."""
    groups = getattr(module, "num_key_value_groups", 1)
    extra = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux"))
    if groups == 1 or attention_mask is None or query.shape[2] == 1 or extra:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)


def use_gqa_sdpa(model: PreTrainedModel) -> bool:
    """Switch ``model`` to :data:`GQA_SDPA` when it runs on CPU with ``sdpa``; returns whether it did.

    CUDA keeps ``sdpa``: there a mask with grouped K/V falls back to the math kernel.
    """
    device = next(model.parameters()).device
    if device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(GQA_SDPA)
    return model.config._attn_implementation == GQA_SDPA
