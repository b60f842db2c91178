"""The frozen target LLM: loading, prefill, tree forward over a KV cache, features.

Shapes: ``B`` batch, ``T``/``n`` query length, ``P`` cached prefix length, ``H`` hidden size,
``V`` vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from taps_ray import artifacts
from taps_ray.config import TargetConfig
from taps_ray.models.attention import use_gqa_sdpa

log = logging.getLogger(__name__)

EMBEDDED_PREFIX = "embedded:"


class TargetLoadError(RuntimeError):
    """The target model could not be loaded; the message names the source."""


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
    """``logits`` [B, n, V] float32, ``hidden`` [B, n, H] (last hidden state after final norm)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    cache: DynamicCache | None


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_native_bf16() -> str | None:
    """The CPU flag that gives this machine native bfloat16 matmuls (``avx512_bf16``/``amx_bf16``), or None.

    Read from ``/proc/cpuinfo`` (Linux); elsewhere None, so ``auto`` stays float32.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return None
    return next((flag for flag in NATIVE_BF16_CPU_FLAGS if flag in flags), None)


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``auto`` device: cuda when a GPU is visible, else cpu. ``auto`` dtype: bfloat16 on cuda and on a CPU
    with native bf16 (:func:`cpu_native_bf16`; 1.5x fp32 decode speed there, docs/BENCHMARKS.md), else float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TargetLoadError(f"device {device!r} requested but CUDA is not available; use device=cpu or auto")
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" or (dev.type == "cpu" and cpu_native_bf16()) else "float32"
    return dev, getattr(torch, dtype)


def dtype_reason(device: torch.device, dtype: torch.dtype, requested: str) -> str:
    """One line saying which dtype ``requested`` resolved to on ``device`` and why."""
    name = str(dtype).removeprefix("torch.")
    if requested != "auto":
        return f"{name} (set in the config)"
    if device.type == "cuda":
        return f"{name} (auto: CUDA)"
    flag = cpu_native_bf16()
    if flag:
        return f"{name} (auto: this CPU has native bf16, {flag}; target.dtype=float32 for fp32)"
    return f"{name} (auto: this CPU has no native bf16; target.dtype=bfloat16 to force it)"


def _embedded_hf_folder(name: str) -> Path:
    """Dequantize the embedded GGUF once into a plain HF folder in the cache; return the folder."""
    gguf_path = artifacts.fetch(name)
    folder = artifacts.cache_dir() / "models" / name
    with FileLock(str(folder) + ".lock"):
        if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
            return folder
        log.info("converting %s to an HF folder at %s (once)", gguf_path.name, folder)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config.name_or_path = name
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    return folder


def _load_hf(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, object]:
    if source.endswith(".gguf"):
        path = Path(source)
        if not path.is_file():
            raise TargetLoadError(f"GGUF file {source!r} does not exist")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        model.hf_quantizer = None
        return model, tok
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as err:
        raise TargetLoadError(
            f"cannot load target {source!r}: not a local HF folder and not reachable on the hub ({err}). "
            f"Offline, use model: embedded:smollm2-135m"
        ) from err
    return model, tok


class TargetModel:
    """A frozen causal LM with the operations speculative decoding needs.

    ``forward`` runs ``tokens`` [B, n] at ``positions`` [B, n] on top of ``cache`` (prefix length
    P) with an optional additive float mask [B, 1, n, P + n]; without a mask the new tokens are
    causal among themselves. The cache is extended in place by n entries.
    """

    def __init__(self, model: PreTrainedModel, tokenizer, name: str):
        model.eval().requires_grad_(False)
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

    @classmethod
    def load(cls, cfg: TargetConfig | None = None) -> TargetModel:
        """Load from ``embedded:NAME``, an HF id (``hf:`` optional), a local folder or a ``.gguf``."""
        cfg = cfg or TargetConfig()
        device, dtype = resolve_device_dtype(cfg.device, cfg.dtype)
        if cfg.threads and device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        start = time.perf_counter()
        source = cfg.model
        if source.startswith(EMBEDDED_PREFIX):
            key = source[len(EMBEDDED_PREFIX):]
            if key not in artifacts.EMBEDDED or not key.startswith("smollm2"):
                raise TargetLoadError(f"unknown embedded target {source!r}; valid: embedded:smollm2-135m")
            folder = _embedded_hf_folder(key)
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        else:
            model, tokenizer = _load_hf(source.removeprefix("hf:"), dtype)
        model.to(device)
        target = cls(model, tokenizer, name=source)
        if cfg.max_context:
            target.max_context = min(target.max_context, cfg.max_context)
        target.dtype_note = dtype_reason(device, dtype, cfg.dtype)
        log.info("target %s loaded on %s in %.1fs, dtype %s", source, device, time.perf_counter() - start,
                 target.dtype_note)
        return target

    def _embed_hash(self) -> str:
        """sha256 of 64 embedding rows rounded to bfloat16: the same for fp32 and bf16 loads of one checkpoint."""
        weight = self.embed_tokens.weight.detach()
        rows = torch.linspace(0, weight.shape[0] - 1, steps=min(64, weight.shape[0])).long().to(weight.device)
        sample = weight[rows].to(torch.bfloat16).view(torch.int16).cpu().contiguous()
        return hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        attention_mask_4d: torch.Tensor | None = None,
    ) -> TargetOutput:
        out = self.model.base_model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=attention_mask_4d,
            cache=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state
        return TargetOutput(logits=self.lm_head(hidden).float(), hidden=hidden, cache=cache)

    def prefill(self, input_ids: torch.Tensor, cache: DynamicCache | None = None) -> TargetOutput:
        """Run ``input_ids`` [B, T] causally after ``cache`` (new cache when None)."""
        cache = cache if cache is not None else self.new_cache()
        past = cache.get_seq_length()
        positions = torch.arange(past, past + input_ids.shape[1], device=self.device).expand(input_ids.shape[0], -1)
        return self.forward(input_ids.to(self.device), positions, cache)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced last hidden states [B, T, H] for right-padded ``input_ids`` [B, T]."""
        out = self.model.base_model(input_ids=input_ids.to(self.device),
                               attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                               use_cache=False)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> torch.Tensor:
        """Token ids [1, T] of ``messages`` under the target's chat template."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def describe(self) -> dict:
        return {**self.fingerprint.to_dict(), "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "dtype_note": self.dtype_note, "layers": self.config.num_hidden_layers, "max_context": self.max_context}


@torch.inference_mode()
def crop_cache(cache: DynamicCache, length: int) -> None:
    """Drop every cache entry at position >= ``length`` (in place)."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


@torch.inference_mode()
def compact_cache(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Keep the prefix plus the entries at ``prefix_len + keep`` (``keep`` [k], ascending), in place.

    Used after tree verification: the tree's N entries sit after the prefix; only the accepted
    path's k entries stay, moved to positions ``prefix_len .. prefix_len + k - 1``.
    """
    k = keep.numel()
    index = keep.to(torch.long) + prefix_len
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        kept_k = layer.keys.index_select(-2, index.to(layer.keys.device))
        kept_v = layer.values.index_select(-2, index.to(layer.values.device))
        keys = layer.keys[..., : prefix_len + k, :]
        values = layer.values[..., : prefix_len + k, :]
        keys[..., prefix_len:, :] = kept_k
        values[..., prefix_len:, :] = kept_v
        layer.keys, layer.values = keys, values


def save_fingerprint(path: Path, fingerprint: TargetFingerprint) -> None:
    path.write_text(json.dumps(fingerprint.to_dict(), indent=1))
