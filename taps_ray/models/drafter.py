"""DraftHead: the EAGLE-2 / HASS draft model, its HF-layout checkpoint and weight averaging.

Input at position i is ``fc(concat(embed(token_{i+1}), f_i))`` where ``f_i`` [H] is a target (or
earlier drafter) feature; then one Llama decoder layer with the target's sizes whose input
layernorm is the identity, no final norm. The output ``f̂_{i+1}`` goes through the target's frozen
LM head. The target's embedding and LM head are passed in, never stored.

Shapes: ``B`` batch, ``n`` new positions, ``P`` cached positions, ``H`` hidden, ``V`` (draft) vocab.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from taps_ray.drafter_sources import ReleaseDrafterError, resolve_drafter_dir
from taps_ray.models.target import TargetFingerprint
from taps_ray.models.weight_storage import (
    INT8_ROWWISE,
    PLAIN,
    STORAGES,
    WeightStorageError,
    dequantize,
    quantize_int8_rowwise,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "TapsDraftHead"
EAGLE3_ARCHITECTURE = "TapsEagle3Head"
ARCHITECTURES = (ARCHITECTURE, EAGLE3_ARCHITECTURE)


class DrafterSaveError(ValueError):
    """A drafter cannot be saved where asked (the folder holds something else)."""


def is_drafter_checkpoint(folder: str | Path) -> bool:
    """True when ``folder`` holds a checkpoint written by :meth:`DraftHead.save` (its ``config.json``
    names one of :data:`ARCHITECTURES`)."""
    try:
        return json.loads((Path(folder) / CONFIG_NAME).read_text()).get("architecture") in ARCHITECTURES
    except (OSError, ValueError, AttributeError):
        return False


class DrafterLoadError(RuntimeError):
    """A drafter checkpoint is missing, corrupt, or belongs to another target."""


def drafter_rope(text_config) -> dict | None:
    """The target's RoPE parameters for the drafter's one Llama layer; the full-attention entry when they
    are given per layer type (Gemma-3)."""
    rope = copy.deepcopy(getattr(text_config, "rope_parameters", None))
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    return rope


def drafter_llama_config(target_config) -> LlamaConfig:
    """One-layer Llama config with the target's sizes (hidden, heads, kv heads, head_dim, MLP, activation,
    rope: :func:`drafter_rope`)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    cfg = LlamaConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", text.num_attention_heads),
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        hidden_act=getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu",
        max_position_embeddings=getattr(text, "max_position_embeddings", 2048),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5),
        rope_parameters=drafter_rope(text),
        attention_bias=getattr(text, "attention_bias", False),
        mlp_bias=getattr(text, "mlp_bias", False),
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def check_draft_vocabulary(draft_to_target, vocab_size: int) -> torch.Tensor:
    """``draft_to_target`` as a LongTensor [V_draft] once it is known to map draft ids one-to-one onto
    target ids in ``[0, vocab_size)``; ValueError naming the first id out of range, or a repeated id and
    the two draft ids that map to it.

    A repeated id would make two siblings of a draft tree carry the same token (see
    :mod:`taps_ray.spec.tree`); one out of range would index past the target's LM head.
    """
    ids = torch.as_tensor(draft_to_target)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"draft_to_target must hold integer target ids, got dtype {ids.dtype}")
    ids = ids.to(torch.long)
    if ids.dim() != 1 or ids.numel() < 1:
        raise ValueError(f"draft_to_target must be 1-D with at least one target id, got shape {list(ids.shape)}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        i = int(bad.to(torch.uint8).argmax())
        raise ValueError(f"draft_to_target[{i}] = {int(ids[i])} is outside the target vocabulary [0, {vocab_size})")
    ordered, order = ids.sort(stable=True)
    same = ordered[1:] == ordered[:-1]
    if bool(same.any()):
        at = int(same.to(torch.uint8).argmax())
        raise ValueError(f"draft_to_target repeats target id {int(ordered[at])} (draft ids {int(order[at])} and "
                         f"{int(order[at + 1])}); each draft id must map to a distinct target id")
    return ids


def causal_mask(n: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, n, past + n]: the n new positions see the cache and earlier new ones."""
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)
    return torch.zeros(1, 1, n, past + n, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def target_layers(target_config) -> int:
    """The target's number of decoder layers L (its text config's ``num_hidden_layers``)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return int(text.num_hidden_layers)


class DraftHead(nn.Module):
    """EAGLE-2 draft head sized from ``target_config``.

    ``draft_to_target`` (optional LongTensor [V_draft]) restricts drafting to a reduced vocabulary:
    draft logits are the LM-head rows of those target ids, which must be distinct and in
    ``[0, vocab_size)`` (ValueError otherwise, see :func:`check_draft_vocabulary`).

    Feature contract shared with :class:`~taps_ray.models.eagle3.Eagle3Head`: the drafter reads the target's
    hidden states :attr:`feature_layers` (HF ``hidden_states`` indices: 0 the embeddings, i the output of
    decoder layer i - 1, L the last one after the final norm) concatenated [.., len * H]; :meth:`fuse` maps
    them to the H-wide feature :meth:`forward` takes (its own outputs are fed back as they are);
    :meth:`readout` maps an output to the LM head's input.
    """

    architecture = ARCHITECTURE
    algorithm = "eagle2"
    architecture_fields: tuple[str, ...] = ()

    draft_to_target: torch.Tensor | None

    def __init__(self, target_config, draft_to_target: torch.Tensor | None = None, seed: int = 0,
                 metadata: dict | None = None):
        super().__init__()
        self.config = drafter_llama_config(target_config)
        self.target_layers = target_layers(target_config)
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self._build()
        self._init_weights()
        torch.random.set_rng_state(generator_state)
        self.rotary = LlamaRotaryEmbedding(self.config)
        if draft_to_target is not None:
            draft_to_target = check_draft_vocabulary(draft_to_target, self.config.vocab_size)
        self.register_buffer("draft_to_target", draft_to_target, persistent=False)
        self.metadata: dict = dict(metadata or {})
        self.seed = seed

    def _build(self) -> None:
        """The trainable modules (run under the drafter's seed)."""
        hidden = self.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = LlamaDecoderLayer(self.config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states this drafter reads: the last one, after the final norm."""
        return (self.target_layers,)

    @property
    def row_layers(self) -> int:
        """Hidden states a training row holds for this drafter: its feature layers, then the last hidden state
        (the teacher's) unless it is one of them."""
        return len(self.feature_layers) + (self.target_layers not in self.feature_layers)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The H-wide input feature [.., H] from target features [.., len(feature_layers) * H] (here: as is)."""
        return features

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's input [.., H] from an output f̂ [.., H] (here: f̂ itself)."""
        return hidden

    def _apply(self, fn, recurse: bool = True):
        """``.to()``/``.half()``/... cast parameters; the rotary frequencies stay float32 (rounding them
        to bf16 would shift every angle)."""
        inv_freq = self.rotary.inv_freq.float()
        original = self.rotary.original_inv_freq.float()
        super()._apply(fn, recurse)
        device = self.fc.weight.device
        self.rotary.inv_freq = inv_freq.to(device)
        self.rotary.original_inv_freq = original.to(device)
        return self

    def _init_weights(self) -> None:
        std = 0.02
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.draft_to_target is None else int(self.draft_to_target.numel())

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def forward(
        self,
        token_embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder layer's outputs [B, n, H]: EAGLE-2's predicted next features f̂, EAGLE-3's pre-norm outputs
        (each fed back as the next level's feature).

        ``token_embeds`` [B, n, H] embeds token_{i+1}; ``features`` [B, n, H] are f_i (fused by :meth:`fuse`: target
        features or the drafter's own outputs); ``positions`` [B, n]; ``attention_mask`` additive
        [B, 1, n, P + n] (causal over the cache when None). ``cache`` is extended in place by n entries.
        """
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = causal_mask(features.shape[1], past, features.dtype, features.device)
        position_embeddings = self.rotary(features, positions)  # cos/sin from fp32 angles, cast to the features' dtype
        return self.decode(token_embeds.to(features.dtype), features, attention_mask.to(features.dtype), positions,
                           position_embeddings, cache)

    def decode(self, embeds: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor,
               positions: torch.Tensor, position_embeddings: tuple, cache: DynamicCache | None) -> torch.Tensor:
        """The decoder layer on ``embeds`` and ``features`` [B, n, H], both in the features' dtype."""
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        return self.layer(hidden, attention_mask=attention_mask, position_ids=positions, cache=cache,
                          use_cache=cache is not None, position_embeddings=position_embeddings)

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, n, V_draft] from f̂ [B, n, H] (:meth:`readout`) through the target's LM head."""
        return self.vocab_logits(self.readout(hidden), lm_head_weight)

    def vocab_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Logits [.., V_draft] float32 of LM-head inputs ``hidden`` [.., H] over the draft vocabulary (the
        target's own distribution when ``hidden`` is the target's last hidden state)."""
        weight = lm_head_weight if self.draft_to_target is None else lm_head_weight[self.draft_to_target]
        return torch.nn.functional.linear(hidden, weight.to(hidden.dtype)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}

    def save(self, directory: str | Path, fingerprint: TargetFingerprint, extra: dict | None = None,
             weight_storage: str = PLAIN) -> Path:
        """Write ``config.json`` + ``model.safetensors`` atomically (via a uniquely named partial folder
        beside it), weights stored as ``weight_storage`` (:mod:`taps_ray.models.weight_storage`). An existing
        ``directory`` is replaced only when it is empty or a drafter checkpoint (:func:`is_drafter_checkpoint`);
        anything else raises :class:`DrafterSaveError`, untouched."""
        if weight_storage not in STORAGES:
            raise WeightStorageError(f"weight_storage {weight_storage!r} is not one of {', '.join(STORAGES)}")
        directory = Path(directory)
        if directory.exists() and not is_drafter_checkpoint(directory) and (
                not directory.is_dir() or any(directory.iterdir())):
            raise DrafterSaveError(f"{directory} exists and is not a drafter checkpoint (no {CONFIG_NAME} with "
                                   f"architecture in {ARCHITECTURES}); refusing to replace it: choose another folder")
        partial = directory.with_name(f".{directory.name}.partial.{os.getpid()}.{secrets.token_hex(4)}")
        partial.mkdir(parents=True)
        try:
            self._write(partial, fingerprint, extra, weight_storage)
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(partial, directory)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return directory

    def _write(self, partial: Path, fingerprint: TargetFingerprint, extra: dict | None, weight_storage: str) -> None:
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.trainable_state().items()}
        if weight_storage == INT8_ROWWISE:
            tensors = quantize_int8_rowwise(tensors)
        if self.draft_to_target is not None:
            tensors["draft_to_target"] = self.draft_to_target.cpu()
        save_file(tensors, str(partial / WEIGHTS_NAME))
        meta = {
            "architecture": self.architecture,
            **self.architecture_config(),
            "drafter": self.config.to_dict(),
            "draft_vocab_size": self.draft_vocab_size,
            "target": fingerprint.to_dict(),
            "seed": self.seed,
            **self.metadata,
            **(extra or {}),
            **({} if weight_storage == PLAIN else {"weight_storage": weight_storage}),
        }
        (partial / CONFIG_NAME).write_text(json.dumps(meta, indent=1, default=str))

    def architecture_config(self) -> dict:
        """Architecture fields ``config.json`` records beside ``architecture`` (none for EAGLE-2)."""
        return {}

    @classmethod
    def from_meta(cls, target_config, meta: dict, draft_to_target: torch.Tensor | None, metadata: dict) -> DraftHead:
        """A fresh head of this architecture for a checkpoint's ``config.json`` ``meta``."""
        return cls(target_config, draft_to_target=draft_to_target, seed=meta.get("seed", 0), metadata=metadata)

    @classmethod
    def load(cls, directory: str | Path, target_config, fingerprint: TargetFingerprint,
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DraftHead:
        """Load a checkpoint saved by :meth:`save` or an EAGLE-1/EAGLE-2 folder (see
        :mod:`taps_ray.models.eagle_format`), a folder or ``release:NAME``; fails if it was trained for
        another target or its ``draft_to_target`` is not a one-to-one map into the target vocabulary.
        ``DraftHead.load`` returns the architecture the checkpoint names (:func:`head_class`); a subclass's
        ``load`` refuses a checkpoint of another architecture."""
        directory, meta = _checkpoint_meta(directory)
        if meta.get("architecture") not in ARCHITECTURES:
            from taps_ray.models.eagle_format import is_eagle_config, load_eagle

            if is_eagle_config(meta) and cls.architecture == ARCHITECTURE:
                return load_eagle(directory, meta, target_config, fingerprint, device, dtype)
            raise DrafterLoadError(
                f"drafter {str(directory)!r}: architecture {meta.get('architecture')!r}, expected one of "
                f"{ARCHITECTURES} or an EAGLE-1/EAGLE-2 checkpoint"
            )
        found = head_class(meta["architecture"])
        if cls is not DraftHead and found is not cls:
            raise DrafterLoadError(f"drafter {str(directory)!r} is a {meta['architecture']} checkpoint "
                                   f"({found.algorithm}); it cannot be loaded as a {cls.architecture} ({cls.algorithm})")
        problem = fingerprint.mismatch(meta.get("target", {}))
        if problem:
            raise DrafterLoadError(f"drafter {str(directory)!r} was trained for another target: {problem}")
        tensors, d2t = _checkpoint_weights(directory, meta, fingerprint)
        keep = {"architecture", "drafter", "draft_vocab_size", "target", "seed", "weight_storage",
                *found.architecture_fields}
        try:
            head = found.from_meta(target_config, meta, d2t, {k: v for k, v in meta.items() if k not in keep})
        except ValueError as err:
            raise DrafterLoadError(f"drafter {str(directory)!r}: {err}") from None
        missing, unexpected = head.load_state_dict(tensors, strict=False)
        missing = [k for k in missing if not k.startswith("rotary.")]
        if missing or unexpected:
            raise DrafterLoadError(
                f"drafter {str(directory)!r}: weights do not match the architecture "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        return head.to(device=device, dtype=dtype).eval()


def _checkpoint_meta(directory: str | Path) -> tuple[Path, dict]:
    """The checkpoint folder ``directory`` names (a folder or ``release:NAME``) and its parsed
    :data:`CONFIG_NAME`; :class:`DrafterLoadError` when either is missing or unreadable."""
    try:
        folder = resolve_drafter_dir(directory)
    except ReleaseDrafterError as err:
        raise DrafterLoadError(str(err)) from None
    if not folder.is_dir():
        raise DrafterLoadError(f"drafter directory {str(folder)!r} does not exist")
    try:
        meta = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DrafterLoadError(f"drafter {str(folder)!r}: unreadable {CONFIG_NAME}: {err}") from err
    return folder, meta


def _checkpoint_weights(directory: Path, meta: dict,
                        fingerprint: TargetFingerprint) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The checkpoint's dequantized tensors without ``draft_to_target``, and that map checked against the
    target vocabulary (None when absent); :class:`DrafterLoadError` when unreadable or invalid."""
    try:
        tensors = load_file(str(directory / WEIGHTS_NAME))
    except Exception as err:  # safetensors raises several types for truncated/corrupt files
        raise DrafterLoadError(f"drafter {str(directory)!r}: unreadable {WEIGHTS_NAME}: {err}") from err
    try:
        tensors = dequantize(tensors, meta.get("weight_storage", PLAIN))
    except WeightStorageError as err:
        raise DrafterLoadError(f"drafter {str(directory)!r}: {err}") from None
    d2t = tensors.pop("draft_to_target", None)
    if d2t is not None:
        try:
            d2t = check_draft_vocabulary(d2t, fingerprint.vocab_size)
        except ValueError as err:
            raise DrafterLoadError(f"drafter {str(directory)!r}: bad draft vocabulary in {WEIGHTS_NAME}: "
                                   f"{err}") from None
    return tensors, d2t


def head_class(architecture: str) -> type[DraftHead]:
    """The drafter class a checkpoint's ``architecture`` names (one of :data:`ARCHITECTURES`)."""
    if architecture == EAGLE3_ARCHITECTURE:
        from taps_ray.models.eagle3 import Eagle3Head

        return Eagle3Head
    if architecture == ARCHITECTURE:
        return DraftHead
    raise ValueError(f"unknown drafter architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")


def drafter_class(algorithm: str) -> type[DraftHead]:
    """The drafter class a training ``algorithm`` trains: eagle3 -> Eagle3Head, eagle2 and hass -> DraftHead."""
    return head_class(EAGLE3_ARCHITECTURE if algorithm == "eagle3" else ARCHITECTURE)


def read_drafter_meta(directory: str | Path) -> dict:
    return json.loads((Path(directory) / CONFIG_NAME).read_text())


def average_drafters(heads: list[DraftHead], weights: list[float]) -> DraftHead:
    """Weight-space interpolation ``sum_i w_i * theta_i`` tensor by tensor (weights sum to 1)."""
    if len(heads) != len(weights) or len(heads) < 1:
        raise ValueError(f"need one weight per drafter, got {len(heads)} drafters and {len(weights)} weights")
    if any(w < 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"weights must be >= 0 and sum to 1, got {weights}")
    for i, h in enumerate(heads[1:], start=1):
        if type(h) is not type(heads[0]) or h.feature_layers != heads[0].feature_layers:
            raise ValueError(f"cannot average drafter 0 ({heads[0].architecture}, {heads[0].algorithm}, target layers "
                             f"{list(heads[0].feature_layers)}) with drafter {i} ({h.architecture}, {h.algorithm}, "
                             f"target layers {list(h.feature_layers)}): averaging needs one architecture")
    states = [h.trainable_state() for h in heads]
    shapes = {k: v.shape for k, v in states[0].items()}
    for i, state in enumerate(states[1:], start=1):
        if {k: v.shape for k, v in state.items()} != shapes:
            raise ValueError(f"drafter {i} has a different architecture/shape than drafter 0")
    first = heads[0]
    for h in heads[1:]:
        if (h.draft_to_target is None) != (first.draft_to_target is None) or (
            h.draft_to_target is not None and not torch.equal(h.draft_to_target, first.draft_to_target)
        ):
            raise ValueError("drafters use different draft vocabularies; cannot average")
    merged = copy.deepcopy(first)
    averaged = {k: sum(w * s[k].float() for w, s in zip(weights, states)).to(states[0][k].dtype) for k in shapes}
    merged.load_state_dict(averaged, strict=False)
    merged.metadata = {"averaged_from": [h.metadata.get("name") for h in heads], "weights": list(weights)}
    return merged
