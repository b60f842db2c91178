"""Eagle3Head: the EAGLE-3 draft model (a fusion of three target layers, training-time test).

Input at position i: the token embedding ``e = embed(token_{i+1})`` and a feature ``g_i`` [H]: at the
first drafting level ``g_i = fc(concat(h^a_i, h^b_i, h^c_i))`` with ``fc: Linear(3H -> H, no bias)`` over the
target's hidden states at a low, a middle and a high layer (:func:`aux_layers`); at deeper levels the
drafter's own output (pre-norm, no fc). One decoder layer whose attention reads ``concat(norm(e),
norm(g))`` (2H: q/k/v from 2H), the residual being ``g``; an MLP on H; a final norm (:meth:`readout`)
before the LM head. The LM head is the target's, frozen, restricted to the draft vocabulary as for
:class:`~taps_ray.models.drafter.DraftHead` (its rows at ``draft_to_target``); the embedding is the
target's too. State-dict names follow the EAGLE-3 layout: ``fc``, ``midlayer.*``, ``norm``.

Shapes: ``B`` batch, ``n`` new positions, ``P`` cached positions, ``H`` hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

from taps_ray.models.drafter import EAGLE3_ARCHITECTURE, DraftHead, target_layers


def aux_layers(layers: int) -> tuple[int, int, int]:
    """The 0-based decoder layers whose outputs EAGLE-3 fuses for a target of ``layers`` layers: 1,
    ``layers // 2 - 1`` and ``layers - 4`` (SpecForge's and vLLM's default); ValueError below 5 layers."""
    if layers < 5:
        raise ValueError(f"an EAGLE-3 drafter needs a target of at least 5 layers, got {layers}")
    return 1, layers // 2 - 1, layers - 4


class Eagle3Layer(nn.Module):
    """The drafter's decoder layer: attention over ``concat(input_layernorm(e), hidden_norm(g))`` [.., 2H],
    residual ``g``, then the usual post-attention norm and MLP."""

    def __init__(self, config):
        super().__init__()
        hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.self_attn = LlamaAttention(config, layer_idx=0)
        d = self.self_attn.head_dim
        bias = config.attention_bias
        self.self_attn.q_proj = nn.Linear(2 * hidden, heads * d, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, kv * d, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, kv * d, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], cache: DynamicCache | None) -> torch.Tensor:
        """[B, n, H] from ``embeds`` and ``features`` [B, n, H]; ``cache`` is extended by n entries."""
        attn_in = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        attn, _ = self.self_attn(attn_in, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                 cache=cache)
        x = features + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(DraftHead):
    """EAGLE-3 draft head sized from ``target_config``; ``aux`` the 0-based target layers it fuses (None:
    :func:`aux_layers`). Draft vocabulary, checkpoint, dtype handling: as :class:`DraftHead`."""

    architecture = EAGLE3_ARCHITECTURE
    algorithm = "eagle3"
    architecture_fields = ("aux_layers", "target_layers")

    def __init__(self, target_config, draft_to_target: torch.Tensor | None = None, seed: int = 0,
                 metadata: dict | None = None, aux: Sequence[int] | None = None):
        layers = target_layers(target_config)
        self.aux = tuple(int(i) for i in (aux_layers(layers) if aux is None else aux))
        if len(self.aux) != 3 or not all(0 <= i < layers for i in self.aux):
            raise ValueError(f"aux layers must be 3 decoder layers in [0, {layers}), got {list(self.aux)}")
        super().__init__(target_config, draft_to_target, seed, metadata)

    def _build(self) -> None:
        hidden = self.config.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(self.config)
        self.norm = LlamaRMSNorm(hidden, eps=self.config.rms_norm_eps)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """HF ``hidden_states`` indices of the aux layers' outputs (decoder layer i -> index i + 1)."""
        return tuple(i + 1 for i in self.aux)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` of the three target layers [.., 3H] -> [.., H]."""
        return self.fc(features)

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of an output [.., H]."""
        return self.norm(hidden)

    def architecture_config(self) -> dict:
        return {"aux_layers": list(self.aux), "target_layers": self.target_layers}

    @classmethod
    def from_meta(cls, target_config, meta: dict, draft_to_target: torch.Tensor | None, metadata: dict) -> Eagle3Head:
        layers = target_layers(target_config)
        if meta.get("target_layers", layers) != layers:
            raise ValueError(f"an EAGLE-3 drafter of a {meta['target_layers']}-layer target, this target has {layers}")
        return cls(target_config, draft_to_target=draft_to_target, seed=meta.get("seed", 0), metadata=metadata,
                   aux=meta.get("aux_layers"))

    def decode(self, embeds: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor,
               positions: torch.Tensor, position_embeddings: tuple, cache: DynamicCache | None) -> torch.Tensor:
        return self.midlayer(embeds, features, attention_mask, position_embeddings, cache)
