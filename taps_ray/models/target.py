"""The frozen target LLM: loading, prefill, tree forward over a KV cache, features.

Shapes: ``B`` batch, ``T``/``n`` query length, ``P`` cached prefix length, ``H`` hidden size,
``V`` vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import overload

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from taps_ray import artifacts
from taps_ray.config import TargetConfig
from taps_ray.models.attention import use_gqa_sdpa
from taps_ray.models.engine import KVCache, Segment, StaticEngine, static_support
from taps_ray.models.quant import Int4Weight, int4_unsupported, read_gguf_q4_1
from taps_ray.models.target_cache import TargetCache
from taps_ray.models.target_loading import (
    EMBEDDED_PREFIX,
    TargetLoadError,
    attention_windows,
    dtype_reason,
    embedded_hf_folder,
    embedded_name,
    load_hf_model,
    resolve_device_dtype,
    resolve_weights,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetFingerprint:
    """Identity of a target: drafters and feature caches are only valid for the same one."""

    name: str
    hidden_size: int
    vocab_size: int
    embed_hash: str

    def mismatch(self, other: TargetFingerprint | dict) -> str | None:
        """Return a message naming the first differing field, or None when they match.

        ``name`` is informational (the same weights may be loaded under two names); sizes and the
        embedding hash decide.
        """
        other = other if isinstance(other, dict) else asdict(other)
        for field in ("hidden_size", "vocab_size", "embed_hash"):
            if other.get(field) != getattr(self, field):
                return (
                    f"target fingerprint field {field!r} differs: expected {getattr(self, field)!r} "
                    f"(target {self.name!r}), found {other.get(field)!r} (target {other.get('name')!r})"
                )
        return None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TargetOutput:
    """``logits`` [B, n, V] float32, ``hidden`` [B, n, H] (last hidden state after final norm), ``features``
    [B, n, F]: the hidden states a forward's ``layers`` asked for, concatenated (None: ``hidden`` is them)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    cache: TargetCache | None
    features: torch.Tensor | None = None

    @property
    def drafter_features(self) -> torch.Tensor:
        """What the drafters of the forward's ``layers`` read: ``features``, or ``hidden`` when None."""
        return self.hidden if self.features is None else self.features


def union_layers(groups) -> tuple[int, ...] | None:
    """The feature layers [HF ``hidden_states`` indices] of several drafters in one tuple, each once, in order of
    first appearance; None when every group is None (the last hidden state only)."""
    seen = [layer for group in groups if group is not None for layer in group]
    return tuple(dict.fromkeys(seen)) if seen else None


def layer_columns(have: tuple[int, ...], want: tuple[int, ...], hidden_size: int) -> torch.Tensor:
    """Column indices [len(want) * H] that pick hidden states ``want`` out of features laid out as ``have``
    ([.., len(have) * H]); ValueError naming a wanted layer that ``have`` lacks."""
    missing = [layer for layer in want if layer not in have]
    if missing:
        raise ValueError(f"target features hold hidden states {list(have)}; a drafter needs {list(want)} "
                         f"(missing {missing})")
    starts = torch.tensor([have.index(layer) * hidden_size for layer in want])
    return (starts[:, None] + torch.arange(hidden_size)).reshape(-1)


def embed_hash(weight: torch.Tensor) -> str:
    """sha256 of 64 rows of the embedding ``weight`` [V, H] rounded to bfloat16: the same for fp32 and bf16 loads
    of one checkpoint (the fingerprint's ``embed_hash``)."""
    weight = weight.detach()
    rows = torch.linspace(0, weight.shape[0] - 1, steps=min(64, weight.shape[0])).long().to(weight.device)
    sample = weight[rows].to(torch.bfloat16).view(torch.int16).cpu().contiguous()
    return hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]


class TargetModel:
    """A frozen causal LM with the operations speculative decoding needs.

    ``forward`` runs ``tokens`` [B, n] at ``positions`` [B, n] on top of ``cache`` (prefix length
    P, positions ``0 .. P-1``) with an optional additive float mask [B, 1, n, P + n]; without a mask
    the new tokens are causal among themselves. Sliding-window layers additionally see only keys
    less than their window behind the query. The cache is extended in place by n entries.

    Families whose verification would not be exact are refused with :class:`TargetLoadError`
    (see :func:`attention_windows`; also an LM head whose logits are not ``lm_head(hidden)``, final
    soft-capping included).
    """

    def __init__(self, model: PreTrainedModel, tokenizer, name: str, engine: str = "auto", weights: str = "dense",
                 gguf: Path | None = None, weights_required: bool = False, graphs: str = "off",
                 compile: bool = False):
        model.eval().requires_grad_(False)
        self.windows = attention_windows(model, name)
        self.engine = _engine(model, self.windows, name, engine, weights, gguf, weights_required, graphs, compile)
        self.weights = self.engine.weights if self.engine is not None else "dense"
        text = model.config.get_text_config(decoder=True)
        self.final_softcap: float | None = getattr(text, "final_logit_softcapping", None)
        if getattr(text, "attn_logit_softcapping", None) is not None and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation("eager")
        use_gqa_sdpa(model)
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.dtype_note = str(self.dtype).removeprefix("torch.")
        self.embed_tokens: torch.nn.Embedding = model.get_input_embeddings()
        self.lm_head: torch.nn.Linear = model.get_output_embeddings()
        self.hidden_size: int = self.config.hidden_size
        self.vocab_size: int = self.embed_tokens.weight.shape[0]
        self.max_context: int = int(getattr(self.config, "max_position_embeddings", 2048))
        self.fingerprint = TargetFingerprint(
            name=name, hidden_size=self.hidden_size, vocab_size=self.vocab_size, embed_hash=self._embed_hash()
        )
        eos = self.config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self._check_head()

    @classmethod
    def load(cls, cfg: TargetConfig | None = None) -> TargetModel:
        """Load from ``embedded:NAME``, an HF id (``hf:`` optional), a local folder or a ``.gguf``."""
        cfg = cfg or TargetConfig()
        device, dtype = resolve_device_dtype(cfg.device, cfg.dtype)
        if cfg.threads and device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        start = time.perf_counter()
        source = cfg.model
        gguf = None
        if source.startswith(EMBEDDED_PREFIX):
            folder = embedded_hf_folder(embedded_name(source))
            gguf = artifacts.fetch(embedded_name(source))
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        else:
            model, tokenizer = load_hf_model(source.removeprefix("hf:"), dtype)
            gguf = Path(source) if source.endswith(".gguf") else None
        model.to(device)
        weights = resolve_weights(cfg.weights, device, dtype, source, cfg.dtype)
        if cfg.compile and cfg.weights == "auto" and weights != "int4" and int4_unsupported(device, dtype) is None:
            weights = "int4"  # compiled steps run torch's int4 kernel, wherever it runs
        target = cls(model, tokenizer, name=source, engine=cfg.engine, weights=weights, gguf=gguf,
                     weights_required=cfg.weights != "auto", graphs=cfg.graphs, compile=cfg.compile)
        if cfg.int4_max_rows is not None:
            if target.engine is not None and target.engine.int4_max_rows is not None:
                target.engine.set_int4_max_rows(cfg.int4_max_rows)
                target.engine.int4_rows_pinned = True
            else:
                log.warning("target.int4_max_rows=%d has no effect: this target's weights (%s) have no int4 codes "
                            "with a packed dense copy (a GGUF target with weights int4)", cfg.int4_max_rows,
                            target.weights)
        if cfg.max_context:
            target.max_context = min(target.max_context, cfg.max_context)
        target.dtype_note = dtype_reason(device, dtype, cfg.dtype)
        log.info("target %s loaded on %s in %.1fs, dtype %s, weights %s", source, device, time.perf_counter() - start,
                 target.dtype_note, target.weights)
        return target

    def _embed_hash(self) -> str:
        return embed_hash(self.embed_tokens.weight)

    @torch.inference_mode()
    def _check_head(self) -> None:
        """TargetLoadError unless :meth:`logits` of the base model's hidden states equal the model's own logits."""
        ids = torch.arange(min(6, self.vocab_size), device=self.device)[None]
        own = self.model(input_ids=ids, use_cache=False).logits.float()
        ours = self.logits(self.model.base_model(input_ids=ids, use_cache=False).last_hidden_state,
                           module_head=self.weights == "q4q8")  # its int8 head is checked in tests
        tol = max(1e-3, 4 * torch.finfo(self.dtype).eps) * (1 + float(own.abs().max()))
        if not torch.allclose(own, ours, rtol=0, atol=tol):
            raise TargetLoadError(
                f"target {self.name!r} ({self.config.model_type}): its logits are not lm_head(hidden)"
                f"{' soft-capped' if self.final_softcap else ''} (max difference "
                f"{float((own - ours).abs().max()):.3g}); this head is not supported")

    def new_cache(self, capacity: int = 256) -> TargetCache:
        """An empty cache: a preallocated :class:`KVCache` of ``capacity`` entries (it grows when needed)
        when the static engine runs this target, else a :class:`DynamicCache` of full-history layers.
        Either keeps sliding-window layers' whole history (their window is applied by the attention
        mask), so that :func:`~taps_ray.models.target_cache.crop_cache` and
        :func:`~taps_ray.models.target_cache.compact_cache` stay exact."""
        if self.engine is not None:
            return self.engine.new_cache(capacity)
        return DynamicCache()

    def layer_masks(self, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive ``mask`` [B, 1, n, P + n] for every layer, restricted to each layer's window.

        ``positions`` [B, n] are the query positions; keys are the cache's positions ``0 .. P-1`` then
        ``positions``. A key at position q is visible to a query at p of a layer with window w only if
        ``p - q < w`` (as in transformers' sliding masks). One tensor when all layers share a window,
        else ``{"full_attention": .., "sliding_attention": ..}``.
        """
        windows = {w for w in self.windows if w is not None}
        if not windows:
            return mask
        past = mask.shape[-1] - positions.shape[1]
        keys = torch.cat([torch.arange(past, device=positions.device).expand(positions.shape[0], -1), positions], 1)
        window = windows.pop()
        outside = (positions[:, None, :, None] - keys[:, None, None, :]) >= window
        sliding = mask.masked_fill(outside, torch.finfo(mask.dtype).min)
        if None not in self.windows:
            return sliding
        return {"full_attention": mask, "sliding_attention": sliding}

    @property
    def final_layer(self) -> int:
        """The HF ``hidden_states`` index of the last hidden state after the final norm (the layer count L)."""
        return int(self.config.num_hidden_layers)

    def feature_layers(self, layers: tuple[int, ...] | None) -> tuple[int, ...]:
        """``layers`` checked against the target (HF ``hidden_states`` indices in [0, L]); () for None or for
        the last hidden state alone, which every forward returns anyway."""
        if layers is None or tuple(layers) == (self.final_layer,):
            return ()
        bad = [layer for layer in layers if not 0 <= layer <= self.final_layer]
        if bad:
            raise ValueError(f"feature layers {bad} are outside [0, {self.final_layer}] of target {self.name!r}")
        return tuple(layers)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: TargetCache,
        attention_mask_4d: torch.Tensor | None = None,
        layers: tuple[int, ...] | None = None,
    ) -> TargetOutput:
        """Logits and last hidden states of ``tokens`` [B, n] at ``positions`` [B, n] after ``cache`` (extended by
        n); ``layers`` (None: the last hidden state): the hidden states the drafters read, as ``features``."""
        hidden, features = self.forward_features(tokens, positions, cache, attention_mask_4d, layers)
        return TargetOutput(logits=self.logits(hidden), hidden=hidden, cache=cache, features=features)

    @torch.inference_mode()
    def forward_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache: TargetCache,
                       attention_mask_4d: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` without the LM head: the last hidden states [B, n, H]."""
        return self.forward_features(tokens, positions, cache, attention_mask_4d)[0]

    @torch.inference_mode()
    def forward_features(self, tokens: torch.Tensor, positions: torch.Tensor, cache: TargetCache,
                         attention_mask_4d: torch.Tensor | None = None, layers: tuple[int, ...] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward_hidden` and the hidden states ``layers`` concatenated [B, n, len(layers) * H] (None when
        :meth:`feature_layers` of ``layers`` is empty)."""
        layers = self.feature_layers(layers)
        if isinstance(cache, KVCache):
            if tokens.shape[0] != 1:
                raise ValueError(f"a KVCache holds one request; got a batch of {tokens.shape[0]} (forward_segments)")
            mask = None if attention_mask_4d is None else attention_mask_4d[0, 0]
            hidden, features = self.engine.forward_layers(tokens[0], positions[0],
                                                          [Segment(cache, tokens.shape[1], mask)], layers)
            return hidden[None], None if features is None else features[None]
        mask = None if attention_mask_4d is None else self.layer_masks(attention_mask_4d, positions)
        out = self.model.base_model(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache,
                                    use_cache=True, output_hidden_states=bool(layers))
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1) if layers else None
        return out.last_hidden_state, features

    @torch.inference_mode()
    @overload
    def forward_segments(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                         layers: None = None) -> torch.Tensor: ...

    @overload
    def forward_segments(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                         layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def forward_segments(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                         layers: tuple[int, ...] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Several requests' steps packed in one forward (static engine only): ``tokens``/``positions`` [T],
        the segments' tokens one after another; the last hidden states [T, H] (with ``layers``: those and the
        features [T, F] or None, as :meth:`forward_features`). Each segment's cache is extended by its n
        entries, exactly as a forward of that segment alone would."""
        if self.engine is None:
            raise ValueError("forward_segments needs the static engine (target.engine), which this target does not run")
        if layers is None:
            return self.engine.forward(tokens, positions, segments)
        return self.engine.forward_layers(tokens, positions, segments, self.feature_layers(layers))

    def prefill(self, input_ids: torch.Tensor, cache: TargetCache | None = None,
                layers: tuple[int, ...] | None = None) -> TargetOutput:
        """Run ``input_ids`` [B, T] causally after ``cache`` (new cache when None); ``layers`` as :meth:`forward`."""
        cache = cache if cache is not None else self.new_cache()
        past = cache.get_seq_length()
        positions = torch.arange(past, past + input_ids.shape[1], device=self.device).expand(input_ids.shape[0], -1)
        return self.forward(input_ids.to(self.device), positions, cache, layers=layers)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      layers: tuple[int, ...] | None = None) -> torch.Tensor:
        """Teacher-forced last hidden states [B, T, H] for right-padded ``input_ids`` [B, T] (``attention_mask``
        [B, T]: 1 on real tokens; None: all real); with ``layers`` (HF ``hidden_states`` indices) those hidden
        states concatenated, [B, T, len(layers) * H]. On the static engine each row runs unpadded, as its own
        prefill would (the features a drafter sees when it decodes); padded positions are zero."""
        layers = tuple(layers) if layers is not None else (self.final_layer,)
        checked = self.feature_layers(layers)
        if self.engine is not None:
            lengths = ([input_ids.shape[1]] * input_ids.shape[0] if attention_mask is None
                       else attention_mask.sum(1).tolist())
            out = torch.zeros(*input_ids.shape, len(layers) * self.hidden_size, dtype=self.dtype, device=self.device)
            for row, n in enumerate(lengths):
                if n:
                    hidden, features = self.engine.forward_layers(
                        input_ids[row, :n].to(self.device), torch.arange(n, device=self.device),
                        [Segment(self.engine.new_cache(n), n, None)], checked)
                    out[row, :n] = hidden if features is None else features
            return out
        out = self.model.base_model(input_ids=input_ids.to(self.device),
                               attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                               use_cache=False, output_hidden_states=bool(checked))
        if not checked:
            return out.last_hidden_state
        return torch.cat([out.hidden_states[i] for i in checked], dim=-1)

    def logits(self, hidden: torch.Tensor, module_head: bool = False) -> torch.Tensor:
        """Logits [.., V] float32 of ``hidden`` [.., H], soft-capped as the model does (Gemma-2/3); on the
        static engine the head product is its :meth:`~taps_ray.models.engine.StaticEngine.head` (``module_head``:
        the head module itself, as the load check compares)."""
        if self.engine is not None and not module_head:
            logits = self.engine.head(self.lm_head, hidden).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> torch.Tensor:
        """Token ids [1, T] of ``messages`` under the target's chat template. Text inside a message that spells
        a special token (``<|im_start|>system`` ...) is tokenized as plain text, never as that token, so a
        message cannot forge a role header; other messages tokenize exactly as the template does."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        if any(self._spells_special(m.get("content")) for m in messages):
            return torch.tensor([self._encode_literal(messages, add_generation_prompt)], dtype=torch.long,
                                device=self.device)
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def _spells_special(self, content) -> bool:
        if not isinstance(content, str):
            return False
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        specials = {t.content for t in added.values() if getattr(t, "special", False)}
        specials |= set(getattr(self.tokenizer, "all_special_tokens", None) or ())
        return any(token and token in content for token in specials)

    def _encode_literal(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The template rendered around placeholders; the template's own text tokenized with its special
        tokens, each message's content with special-token spellings split into plain text."""
        marks = [f"\x00taps-content-{i}\x00" for i in range(len(messages))]
        shaped = [{**m, "content": mark} if isinstance(m.get("content"), str) else m for m, mark in zip(messages, marks)]
        text = self.tokenizer.apply_chat_template(shaped, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids: list[int] = []
        for message, mark in zip(messages, marks):
            if not isinstance(message.get("content"), str) or mark not in text:
                continue
            before, text = text.split(mark, 1)
            ids += self.tokenizer(before, add_special_tokens=False).input_ids
            ids += self.tokenizer(message["content"], add_special_tokens=False, split_special_tokens=True).input_ids
        return ids + self.tokenizer(text, add_special_tokens=False).input_ids

    @property
    def exact_reference(self) -> bool:
        """Whether this target computes in float32 on its dense weights: the bitwise reference greedy exactness is
        stated against (a bfloat16 or low-bit target's divergences are accounted as ties within rounding)."""
        return self.dtype == torch.float32 and self.weights == "dense"

    @property
    def precision(self) -> str:
        """The dtype, and the weight format where it is not dense: ``float32``, ``float32, fp16 weights`` ..."""
        dtype = str(self.dtype).removeprefix("torch.")
        return dtype if self.weights == "dense" else f"{dtype}, {self.weights} weights"

    def describe(self) -> dict:
        return {**self.fingerprint.to_dict(), "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "dtype_note": self.dtype_note, "engine": "static" if self.engine is not None else "hf",
                "weights": self.weights, "layers": self.config.num_hidden_layers, "max_context": self.max_context}


def _engine(model: PreTrainedModel, windows: list[int | None], name: str, requested: str, weights: str = "dense",
            gguf: Path | None = None, weights_required: bool = False, graphs: str = "off",
            compile: bool = False) -> StaticEngine | None:
    """The static engine for ``model`` when ``requested`` allows it (auto: where the family supports it;
    static: required, TargetLoadError otherwise; hf: never), its layers in ``weights`` (int4: the codes of
    ``gguf``'s Q4_1 tensors where it has them). int4 or fp16 without the static engine is a TargetLoadError when
    ``weights_required`` (set explicitly), else the forward stays dense. ``graphs`` (target.graphs): on
    requires CUDA graphs of the static engine's steps (TargetLoadError where they cannot run), auto takes
    them where they can. ``compile`` (target.compile): compiled narrow int4 steps on CPU (TargetLoadError where
    they cannot run)."""
    if requested not in ("auto", "static", "hf"):
        raise TargetLoadError(f"target.engine must be auto, static or hf, got {requested!r}")
    if graphs not in ("auto", "on", "off"):
        raise TargetLoadError(f"target.graphs must be auto, on or off, got {graphs!r}")
    reason = "target.engine=hf" if requested == "hf" else static_support(model)
    device = next(model.parameters()).device
    graphable = reason is None and device.type == "cuda" and all(window is None for window in windows)
    if graphs == "on" and not graphable:
        raise TargetLoadError(f"target {name!r}: target.graphs=on needs the static engine on a CUDA device without "
                              f"sliding-window layers (engine: {reason or 'static'}, device {device}); use graphs auto or off")
    if reason is None:
        codes: dict[str, Int4Weight] = {}
        if weights in ("int4", "q4q8") and gguf is not None:
            codes = read_gguf_q4_1(gguf, model.config.get_text_config(decoder=True))
        try:
            return StaticEngine(model, windows, weights, codes, graphs=graphable and graphs != "off", compile=compile)
        except ValueError as err:
            raise TargetLoadError(f"target {name!r}: {err}") from err
    if compile:
        raise TargetLoadError(f"target {name!r}: target.compile=true needs the static engine ({reason}); use "
                              f"target.compile=false")
    if weights != "dense" and weights_required:
        raise TargetLoadError(f"target {name!r}: {weights} weights run on the static engine, which this target does not "
                              f"({reason}); use target.weights=dense")
    if requested == "hf":
        return None
    if requested == "static":
        raise TargetLoadError(f"target {name!r}: target.engine=static, but {reason}; use engine auto or hf")
    log.info("target %s runs transformers' forward: %s", name, reason)
    return None


def save_fingerprint(path: Path, fingerprint: TargetFingerprint) -> None:
    path.write_text(json.dumps(fingerprint.to_dict(), indent=1))
