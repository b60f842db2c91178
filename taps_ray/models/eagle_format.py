"""EAGLE-1/EAGLE-2 checkpoint folders (the SafeAILab/EAGLE layout) in and out of :class:`DraftHead`.

An EAGLE-1/2 folder holds ``config.json`` (a one-layer Llama config plus a ``bias`` flag) and
``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight`` [H, 2H], optional ``fc.bias``,
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.post_attention_layernorm.weight`` and an optional ``embed_tokens.weight`` (the target's,
ignored). The architecture is ours: ``fc(concat(embed, feature))``, one Llama layer whose input norm
is skipped, no final norm; ``layers.0.X`` is our ``layer.X``. EAGLE-3 (``midlayer.*``, ``d2t``/``t2d``)
is a different architecture and is refused here (:mod:`taps_ray.models.eagle3_format` reads and writes it).

Export writes one folder per serving engine, because the engines disagree on two points:

- ``sglang`` (default; also what SafeAILab's own loader reads): ``architectures:
  ["LlamaForCausalLMEagle"]``, ``fc.bias`` always written (SGLang's ``fc`` always has a bias; a
  missing one stays uninitialised). SGLang and vLLM build attention biases when ``bias`` is true,
  so zero ``{q,k,v,o}_proj.bias`` tensors go with ``bias: true``. A reduced draft vocabulary becomes
  :data:`TOKEN_MAP_NAME`, the file SGLang's ``--speculative-token-map`` takes (a 1-D int64 tensor of
  target ids; draft id i is target id ``map[i]``).
- ``vllm``: ``architectures: ["EagleLlamaForCausalLM"]`` (the class vLLM maps EAGLE-1/2 Llama heads to).
  vLLM's ``fc`` has no bias and its loader rejects ``fc.bias``, and it reads no token map for
  EAGLE-1/2, so a non-zero ``fc.bias`` (unless dropped on request) or a reduced vocabulary is refused.

The config also carries a ``taps`` block (target fingerprint, seed, metadata, token map name) that
import uses, so export -> import gives the same tensors bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from taps_ray.drafter_sources import ReleaseDrafterError, resolve_drafter_dir
from taps_ray.models.drafter import (
    ARCHITECTURES,
    CONFIG_NAME,
    WEIGHTS_NAME,
    DrafterLoadError,
    DraftHead,
    check_draft_vocabulary,
    drafter_llama_config,
)
from taps_ray.models.target import TargetFingerprint

log = logging.getLogger(__name__)

BIN_WEIGHTS_NAME = "pytorch_model.bin"
TOKEN_MAP_NAME = "hot_token_map.pt"
TRAINED_PROMPTS_NAME = "trained_prompts.json"  # copied along: the contamination guard reads it (data/contamination.py)
ENGINES: dict[str, list[str]] = {"sglang": ["LlamaForCausalLMEagle"], "vllm": ["EagleLlamaForCausalLM"]}
EXPORT_FILES = frozenset({CONFIG_NAME, WEIGHTS_NAME, TOKEN_MAP_NAME, TRAINED_PROMPTS_NAME})
ATTENTION_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
IGNORED_KEYS = ("embed_tokens.weight",)
EAGLE_PREFIX = "layers.0."
OUR_PREFIX = "layer."


@dataclass(frozen=True)
class EagleExport:
    """What :func:`export_eagle` wrote: the folder, the token map (or None) and the ``bias`` flag."""

    path: Path
    engine: str
    token_map: Path | None
    bias: bool
    fc_bias_dropped: bool


class EagleExportError(ValueError):
    """The drafter cannot be written for the requested engine; the message says why and what would work."""


def is_eagle_config(meta: dict) -> bool:
    """True for an HF-style Llama config (EAGLE-1/2/3), False for our own ``TapsDraftHead`` config."""
    return "architecture" not in meta and "hidden_size" in meta


def to_eagle_key(key: str) -> str:
    return EAGLE_PREFIX + key[len(OUR_PREFIX):] if key.startswith(OUR_PREFIX) else key


def from_eagle_key(key: str) -> str:
    return OUR_PREFIX + key[len(EAGLE_PREFIX):] if key.startswith(EAGLE_PREFIX) else key


# -- import --------------------------------------------------------------------------------------

def read_eagle_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The weights of an EAGLE folder, from ``model.safetensors`` or else ``pytorch_model.bin`` (on CPU)."""
    for name in (WEIGHTS_NAME, BIN_WEIGHTS_NAME):
        path = directory / name
        if not path.is_file():
            continue
        try:
            if name == WEIGHTS_NAME:
                return load_file(str(path))
            return torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:  # safetensors / pickle raise several types for corrupt files
            raise DrafterLoadError(f"EAGLE drafter {str(directory)!r}: unreadable {name}: {err}") from err
    raise DrafterLoadError(f"EAGLE drafter {str(directory)!r}: no {WEIGHTS_NAME} or {BIN_WEIGHTS_NAME}")


def eagle3_reason(meta: dict, tensors: dict[str, torch.Tensor]) -> str | None:
    """Why the checkpoint is EAGLE-3 (SpecForge / SafeAILab EAGLE-3 layout), or None."""
    keys = sorted(tensors)
    midlayer = [k for k in keys if k.startswith("midlayer.")]
    if midlayer:
        return f"it has {midlayer[0]!r}"
    vocab_maps = [k for k in keys if k in ("d2t", "t2d")]
    if vocab_maps:
        return f"it has the {'/'.join(vocab_maps)} vocabulary map"
    eagle3_arch = [a for a in meta.get("architectures") or [] if "eagle3" in str(a).lower()]
    if eagle3_arch:
        return f"its architecture is {eagle3_arch[0]!r}"
    fc = tensors.get("fc.weight")
    hidden = meta.get("hidden_size")
    if fc is not None and fc.dim() == 2 and hidden and fc.shape[1] == 3 * hidden:
        return f"fc.weight takes 3 x hidden_size = {fc.shape[1]} inputs (three target layers)"
    return None


def _check_against_target(directory: Path, cfg: LlamaConfig, target_config,
                          fingerprint: TargetFingerprint) -> None:
    expected = drafter_llama_config(target_config)
    where = f"EAGLE drafter {str(directory)!r}"
    if cfg.num_hidden_layers != 1:
        raise DrafterLoadError(f"{where}: num_hidden_layers is {cfg.num_hidden_layers}; only one-layer "
                               f"EAGLE-1/EAGLE-2 heads load (num_hidden_layers: 1)")
    wanted = {"hidden_size": fingerprint.hidden_size, "vocab_size": fingerprint.vocab_size}
    for field in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "hidden_act", "rms_norm_eps", "rope_parameters"):
        wanted[field] = getattr(expected, field)
    for field, valid in wanted.items():
        got = getattr(cfg, field, None)
        if field == "rms_norm_eps":
            same = got is not None and abs(float(got) - float(valid)) <= 1e-12
        else:
            same = got == valid
        if not same:
            raise DrafterLoadError(f"{where}: {field} is {got!r}; target {fingerprint.name!r} needs {valid!r}")


def _eagle_state(directory: Path, meta: dict, tensors: dict[str, torch.Tensor],
                 head: DraftHead) -> dict[str, torch.Tensor]:
    """Our state dict from EAGLE tensors; every shape and the bias rules are checked."""
    where = f"EAGLE drafter {str(directory)!r}"
    state = head.trainable_state()
    mapped: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key in IGNORED_KEYS:
            continue
        mapped[from_eagle_key(key)] = value
    bias_flag = meta.get("bias")
    fc_bias = mapped.get("fc.bias")
    if fc_bias is None:
        if bias_flag is True:
            raise DrafterLoadError(f"{where}: config.json says bias: true but the weights have no fc.bias")
        mapped["fc.bias"] = torch.zeros_like(state["fc.bias"])
    elif bias_flag is False and bool(fc_bias.count_nonzero()):
        raise DrafterLoadError(f"{where}: config.json says bias: false but fc.bias is non-zero (EAGLE's loader "
                               f"would drop it, SGLang's would use it); set bias: true or remove fc.bias")
    for proj in ATTENTION_PROJ:  # zero attention biases that go with bias: true (see the module doc)
        key = f"layer.self_attn.{proj}.bias"
        if key in mapped and key not in state:
            if bool(mapped[key].count_nonzero()):
                raise DrafterLoadError(f"{where}: {to_eagle_key(key)} is non-zero but the target's attention "
                                       f"has no biases (attention_bias false)")
            del mapped[key]
    missing = sorted(to_eagle_key(k) for k in state if k not in mapped)
    unexpected = sorted(to_eagle_key(k) for k in mapped if k not in state)
    if missing or unexpected:
        hint = ""
        if "layers.0.input_layernorm.weight" in unexpected or "norm.weight" in unexpected:
            hint = " (EAGLE-1/2 heads have no input norm on their layer and no final norm)"
        raise DrafterLoadError(f"{where}: weights do not match the EAGLE-1/EAGLE-2 layout: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}{hint}")
    for key, value in mapped.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise DrafterLoadError(f"{where}: {to_eagle_key(key)} has shape {list(value.shape)}; target "
                                   f"needs {list(state[key].shape)}")
    return mapped


def _read_token_map(directory: Path, name: str, vocab_size: int) -> torch.Tensor:
    path = directory / name
    try:
        value = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # missing or corrupt file
        raise DrafterLoadError(f"EAGLE drafter {str(directory)!r}: unreadable token map {name}: {err}") from err
    try:
        ids = check_draft_vocabulary(value, vocab_size)
        if ids.numel() < 2:
            raise ValueError(f"it holds {ids.numel()} target id; need at least 2")
    except (TypeError, ValueError, RuntimeError) as err:
        raise DrafterLoadError(f"EAGLE drafter {str(directory)!r}: token map {name}: {err}") from None
    return ids


def load_eagle(directory: Path, meta: dict, target_config, fingerprint: TargetFingerprint,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DraftHead:
    """A :class:`DraftHead` from an EAGLE-1/EAGLE-2 folder whose ``config.json`` is ``meta``.

    Sizes, heads, rope and norm eps must equal the target's; the ``taps`` block's fingerprint, when
    present, must match ``fingerprint`` (a public checkpoint has none: only the sizes are checked).
    """
    directory = Path(directory)
    tensors = read_eagle_tensors(directory)
    reason = eagle3_reason(meta, tensors)
    if reason:
        raise DrafterLoadError(f"drafter {str(directory)!r} is an EAGLE-3 checkpoint ({reason}); only EAGLE-1/"
                               f"EAGLE-2 heads (fc over embedding + one target feature, layers.0.*) load")
    try:
        cfg = LlamaConfig.from_dict({k: v for k, v in meta.items() if k != "taps"})
    except Exception as err:  # noqa: BLE001  (transformers raises several types for a bad config)
        raise DrafterLoadError(f"EAGLE drafter {str(directory)!r}: {CONFIG_NAME} is not a Llama config: {err}") from err
    _check_against_target(directory, cfg, target_config, fingerprint)
    taps = meta.get("taps") or {}
    if taps.get("target"):
        problem = fingerprint.mismatch(taps["target"])
        if problem:
            raise DrafterLoadError(f"drafter {str(directory)!r} was trained for another target: {problem}")
    else:
        log.info("EAGLE drafter %s names no target: checked by sizes against %s", directory, fingerprint.name)
    token_map = taps.get("token_map")
    d2t = _read_token_map(directory, token_map, fingerprint.vocab_size) if token_map else None
    metadata = taps.get("metadata") if "metadata" in taps else {"name": directory.name, "format": "eagle"}
    head = DraftHead(target_config, draft_to_target=d2t, seed=int(taps.get("seed", 0)), metadata=metadata)
    head.load_state_dict(_eagle_state(directory, meta, tensors, head), strict=False)
    return head.to(device=device, dtype=dtype).eval()


# -- export --------------------------------------------------------------------------------------

def load_taps_drafter(spec: str | Path) -> tuple[DraftHead, TargetFingerprint, Path]:
    """Our own drafter folder (or ``release:NAME``; an EAGLE-2/HASS or an EAGLE-3 head) without loading its
    target: the sizes come from the drafter config it stores, the fingerprint from its ``target`` record."""
    try:
        directory = resolve_drafter_dir(spec)
    except ReleaseDrafterError as err:
        raise DrafterLoadError(str(err)) from None
    try:
        meta = json.loads((directory / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DrafterLoadError(f"drafter {str(spec)!r}: unreadable {CONFIG_NAME}: {err}") from err
    if meta.get("architecture") not in ARCHITECTURES:
        what = "already an EAGLE checkpoint" if is_eagle_config(meta) else f"architecture {meta.get('architecture')!r}"
        raise DrafterLoadError(f"drafter {str(spec)!r}: {what}; export takes one of our drafter folders "
                               f"({', '.join(ARCHITECTURES)})")
    try:
        fingerprint = TargetFingerprint(**meta["target"])
    except (KeyError, TypeError) as err:
        raise DrafterLoadError(f"drafter {str(spec)!r}: {CONFIG_NAME} has no valid target record: {err}") from err
    sizes = LlamaConfig.from_dict(meta["drafter"])
    if "target_layers" in meta:  # an EAGLE-3 head checks its fused layers against the target's depth
        sizes.num_hidden_layers = int(meta["target_layers"])
    head = DraftHead.load(directory, sizes, fingerprint)
    return head, fingerprint, directory


def eagle_config(head: DraftHead, fingerprint: TargetFingerprint, engine: str, bias: bool,
                 fc_bias_dropped: bool, dtype: torch.dtype) -> dict:
    """The ``config.json`` of an export: the drafter's Llama config, ``num_hidden_layers: 1``, the
    engine's ``architectures``, the ``bias`` flag, legacy ``rope_theta``/``rope_scaling`` beside
    ``rope_parameters`` (for older transformers), and the ``taps`` block."""
    cfg = head.config.to_dict()
    for noise in ("id2label", "label2id", "_name_or_path", "output_hidden_states", "output_attentions",
                  "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "dtype",
                  "bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(noise, None)
    rope = dict(cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg.update(
        architectures=list(ENGINES[engine]),
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,  # embedding and LM head are the target's; SGLang swaps both in
        bias=bias,
        rope_theta=rope.get("rope_theta", 10000.0),
        rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    cfg["taps"] = {
        "format": "eagle", "engine": engine, "target": fingerprint.to_dict(), "seed": head.seed,
        "metadata": head.metadata, "draft_vocab_size": head.draft_vocab_size,
        "token_map": TOKEN_MAP_NAME if head.draft_to_target is not None else None,
        "fc_bias_dropped": fc_bias_dropped,
    }
    return cfg


def eagle_tensors(head: DraftHead, engine: str, drop_fc_bias: bool = False) -> tuple[dict[str, torch.Tensor], bool]:
    """The EAGLE-named tensors to write for ``engine`` and the ``bias`` flag (see the module doc)."""
    if engine not in ENGINES:
        raise EagleExportError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    state = {k: v.detach().contiguous().cpu() for k, v in head.trainable_state().items()}
    fc_bias = state.pop("fc.bias")
    nonzero = bool(fc_bias.count_nonzero()) and not drop_fc_bias
    if engine == "vllm":
        if head.draft_to_target is not None:
            raise EagleExportError(
                f"the drafter drafts from a reduced vocabulary of {head.draft_vocab_size} tokens (of "
                f"{head.config.vocab_size}); vLLM reads no draft->target token map for EAGLE-1/EAGLE-2 heads "
                f"(only EAGLE-3 checkpoints carry one): export with --engine sglang, which writes it as "
                f"SGLang's --speculative-token-map file")
        if nonzero:
            raise EagleExportError(
                f"fc.bias is non-zero (max |b| = {float(fc_bias.abs().max()):.3g}); vLLM's EAGLE-1/EAGLE-2 Llama "
                f"head (EagleLlamaForCausalLM) has no fc bias and rejects one: export with --engine sglang, or add "
                f"--drop-fc-bias to write it without (outputs stay exact, since the target verifies every token, "
                f"but acceptance may drop)")
    out = {to_eagle_key(k): v for k, v in state.items()}
    if engine == "sglang":
        out["fc.bias"] = fc_bias if nonzero else torch.zeros_like(fc_bias)
        if nonzero and not head.config.attention_bias:
            for proj in ATTENTION_PROJ:
                weight = out[f"layers.0.self_attn.{proj}.weight"]
                out[f"layers.0.self_attn.{proj}.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return out, nonzero


def check_replaceable(out: Path, files: frozenset[str]) -> None:
    """Refuse an export folder ``out`` that holds anything but an earlier export's ``files``."""
    if out.exists():
        names = sorted(p.name for p in out.iterdir()) if out.is_dir() else [out.name]
        foreign = [name for name in names if not out.is_dir() or name not in files]
        if foreign:
            raise EagleExportError(f"refusing to replace {str(out)!r}: it holds files an export does not write "
                                   f"({', '.join(foreign[:5])})")


def publish(partial: Path, out: Path, source: Path | None) -> None:
    """Finish an export written to ``partial``: add ``source``'s ``trained_prompts.json`` (the contamination
    guard reads it) and put the folder at ``out`` in place of an earlier export."""
    if source is not None and (source / TRAINED_PROMPTS_NAME).is_file():
        shutil.copyfile(source / TRAINED_PROMPTS_NAME, partial / TRAINED_PROMPTS_NAME)
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)


def export_eagle(head: DraftHead, out: str | Path, fingerprint: TargetFingerprint, engine: str = "sglang",
                 drop_fc_bias: bool = False, source: Path | None = None) -> EagleExport:
    """Write ``head`` as an EAGLE-1/2 folder for ``engine`` at ``out`` (atomically, via ``.partial``).

    ``out`` may already hold an earlier export (it is replaced) but nothing else. ``source``, the
    drafter's own folder, lends its ``trained_prompts.json``.
    """
    out = Path(out)
    check_replaceable(out, EXPORT_FILES)
    tensors, bias = eagle_tensors(head, engine, drop_fc_bias)
    dropped = drop_fc_bias and bool(head.fc.bias.detach().count_nonzero())
    dtype = tensors["fc.weight"].dtype
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / WEIGHTS_NAME), metadata={"format": "pt"})
    token_map = None
    if head.draft_to_target is not None:
        torch.save(head.draft_to_target.detach().cpu().to(torch.int64).contiguous(), str(partial / TOKEN_MAP_NAME))
        token_map = out / TOKEN_MAP_NAME
    config = eagle_config(head, fingerprint, engine, bias, dropped, dtype)
    (partial / CONFIG_NAME).write_text(json.dumps(config, indent=1, default=str))
    publish(partial, out, source)
    return EagleExport(path=out, engine=engine, token_map=token_map, bias=bias, fc_bias_dropped=dropped)
