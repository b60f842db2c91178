"""The target's input embedding and LM head without its decoder layers.

Drafter replicas and the drafter-training driver use four things of the target: its config, its
input embedding (``embed(token_{i+1})``), its LM head (draft logits) and its fingerprint. Drafter
features are the target's last hidden states *after* its final norm, and the draft head has no
final norm of its own, so the target's final norm is not needed either. :func:`load_target_head`
reads just those two tensors from the checkpoint's safetensors files, following
``model.safetensors.index.json`` to the shard that holds each (on the hub only those shards are
downloaded), and ties the LM head to the embedding when the config says so or the checkpoint has no
``lm_head`` (SmolLM2). For Llama-3-8B in bf16 that is 2 x 1.05 GB instead of 16 GB.

A GGUF file or a checkpoint without safetensors has no per-tensor index: the full model is loaded
(:meth:`TargetModel.load`) and the head taken from it, with a warning.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from taps_ray.config import TargetConfig
from taps_ray.models.target import TargetFingerprint, TargetModel, embed_hash
from taps_ray.models.target_loading import (
    EMBEDDED_PREFIX,
    TargetLoadError,
    dtype_reason,
    embedded_hf_folder,
    embedded_name,
    resolve_device_dtype,
    resolve_weights,
)

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class TargetHead:
    """What drafting (:func:`taps_ray.spec.tree.draft_tree`, :func:`taps_ray.spec.decoder.load_drafter`)
    and drafter training use of a :class:`TargetModel`, under the same attribute names.

    ``tensors_read``: the checkpoint tensors read (empty after a full-model fallback). ``weights``: the weight
    format the full target runs (``target.weights`` resolved); drafting reads the draft head and the drafter's
    linears in the format :func:`~taps_ray.spec.draft_compute.draft_head_kind` picks for it, as it does in-process.
    """

    name: str
    config: PretrainedConfig
    tokenizer: object
    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    fingerprint: TargetFingerprint
    eos_token_ids: frozenset[int]
    max_context: int
    dtype_note: str
    tensors_read: tuple[str, ...] = ()
    weights: str = "dense"

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1]

    @classmethod
    def of(cls, target: TargetModel) -> TargetHead:
        """The head of an already loaded full target (shares its tensors)."""
        return cls(target.name, target.config, target.tokenizer, target.embed_tokens, target.lm_head,
                   target.fingerprint, target.eos_token_ids, target.max_context, target.dtype_note,
                   weights=target.weights)


def _hub_file(repo: str) -> Callable[[str], Path | None]:
    """A function returning the local path of one file of hub repo ``repo`` (downloaded on first use, with
    ``HF_TOKEN`` for gated repos), or None when the repo has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    def get(filename: str) -> Path | None:
        try:
            return Path(hf_hub_download(repo, filename))
        except EntryNotFoundError:
            return None
        except OSError as err:
            raise TargetLoadError(f"cannot read {filename} of target {repo!r} from the hub ({err}); a gated "
                                  f"model needs HF_TOKEN. Offline, use model: embedded:smollm2-135m") from err

    return get


def _folder_file(folder: Path) -> Callable[[str], Path | None]:
    return lambda filename: (folder / filename) if (folder / filename).is_file() else None


def _tensor_files(get: Callable[[str], Path | None]) -> dict[str, str] | None:
    """``{tensor name: file name}`` of the safetensors checkpoint ``get`` reaches, from its shard index or the
    header of its single file; None when it has neither."""
    index = get(INDEX_FILE)
    if index is not None:
        return dict(json.loads(index.read_text())["weight_map"])
    single = get(SINGLE_FILE)
    if single is None:
        return None
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), SINGLE_FILE)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _checkpoint_key(keys: dict[str, str], module_name: str) -> str | None:
    """The checkpoint name of ``module_name``'s weight: exact, else the one key ending in its last part
    (``embed_tokens.weight`` under another prefix); None when absent."""
    exact = f"{module_name}.weight"
    if exact in keys:
        return exact
    leaf = f"{module_name.rsplit('.', 1)[-1]}.weight"
    found = [k for k in keys if k == leaf or k.endswith("." + leaf)]
    if len(found) > 1:
        raise TargetLoadError(f"checkpoint has several {leaf!r} tensors {found[:4]}; cannot tell which is the "
                              f"target's")
    return found[0] if found else None


def _read(get: Callable[[str], Path | None], files: dict[str, str], key: str) -> torch.Tensor:
    path = get(files[key])
    if path is None:
        raise TargetLoadError(f"checkpoint shard {files[key]!r} (holding {key!r}) is missing")
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(key)


def _tied(config: PretrainedConfig) -> bool:
    text = config.get_text_config(decoder=True)
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def _eos_ids(config: PretrainedConfig, tokenizer) -> frozenset[int]:
    eos = config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _full_model_head(cfg: TargetConfig, why: str) -> TargetHead:
    log.warning("target %s: %s; loading the full model to take its embedding and LM head", cfg.model, why)
    target = TargetModel.load(cfg)
    head = TargetHead.of(target)
    target.model.model.layers = nn.ModuleList()
    return head


def load_target_head(cfg: TargetConfig | None = None) -> TargetHead:
    """The embedding and LM head of ``cfg.model`` (as :meth:`TargetModel.load` names it) on ``cfg.device`` in
    ``cfg.dtype``, read tensor by tensor; its fingerprint equals the full target's."""
    cfg = cfg or TargetConfig()
    device, dtype = resolve_device_dtype(cfg.device, cfg.dtype)
    start = time.perf_counter()
    source = cfg.model
    if source.startswith(EMBEDDED_PREFIX):
        where: str | Path = embedded_hf_folder(embedded_name(source))
        get = _folder_file(where)
    elif source.endswith(".gguf"):
        return _full_model_head(cfg, "a GGUF file has no per-tensor safetensors index")
    else:
        where = source.removeprefix("hf:")
        get = _folder_file(Path(where)) if Path(where).is_dir() else _hub_file(where)
    try:
        config = AutoConfig.from_pretrained(str(where))
        tokenizer = AutoTokenizer.from_pretrained(str(where))
    except OSError as err:
        raise TargetLoadError(
            f"cannot load target {source!r}: not a local HF folder and not reachable on the hub ({err}). "
            f"Offline, use model: embedded:smollm2-135m") from err
    files = _tensor_files(get)
    if files is None:
        return _full_model_head(cfg, "the checkpoint has no safetensors files")

    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters on meta: names and module types, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    embed_module = skeleton.get_input_embeddings()
    embed_key = _checkpoint_key(files, _module_name(skeleton, embed_module))
    if embed_key is None:
        raise TargetLoadError(f"target {source!r}: no input embedding among its checkpoint tensors")
    head_key = None if _tied(config) else _checkpoint_key(files, _module_name(skeleton, skeleton.get_output_embeddings()))
    embed_weight = _read(get, files, embed_key).to(dtype)
    embed_module.weight = nn.Parameter(embed_weight, requires_grad=False)
    embed_module.to(device)
    if head_key is None:
        head_weight = embed_module.weight
    else:
        head_weight = nn.Parameter(_read(get, files, head_key).to(device, dtype), requires_grad=False)
    vocab, hidden = head_weight.shape
    lm_head = nn.Linear(hidden, vocab, bias=False, device="meta")
    lm_head.weight = head_weight
    del skeleton
    text = config.get_text_config(decoder=True)
    max_context = int(getattr(text, "max_position_embeddings", 2048))
    if cfg.max_context:
        max_context = min(max_context, cfg.max_context)
    fingerprint = TargetFingerprint(name=source, hidden_size=text.hidden_size, vocab_size=embed_module.weight.shape[0],
                                    embed_hash=embed_hash(embed_module.weight))
    read = tuple(k for k in (embed_key, head_key) if k is not None)
    head = TargetHead(source, config, tokenizer, embed_module.eval(), lm_head.eval(), fingerprint,
                      _eos_ids(config, tokenizer), max_context, dtype_reason(device, dtype, cfg.dtype), read,
                      weights=resolve_weights(cfg.weights, device, dtype, source, cfg.dtype))
    log.info("target %s: embedding and LM head (%s) loaded on %s in %.1fs, dtype %s", source, ", ".join(read),
             device, time.perf_counter() - start, head.dtype_note)
    return head
