"""What loading a target resolves before its model is built: the source (``embedded:NAME``, the pinned GGUF
dequantised once into a cached HF folder; an HF id or folder; a ``.gguf`` file), the device and dtype
(``auto``: cuda when visible, bfloat16 where matmuls are native), the weight format, each layer's attention
window (:func:`attention_windows`: the layer types a tree mask can serve), and :class:`TargetLoadError`, the
one error a target that cannot be loaded raises, naming the source.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from taps_ray import artifacts
from taps_ray.models.quant import WEIGHT_FORMATS, auto_weights, weights_unsupported
from taps_ray.runstate import write_json

log = logging.getLogger(__name__)

EMBEDDED_PREFIX = "embedded:"


class TargetLoadError(RuntimeError):
    """The target model could not be loaded; the message names the source."""


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


def resolve_weights(requested: str, device: torch.device, dtype: torch.dtype, name: str, dtype_requested: str = "auto") -> str:
    """``target.weights`` resolved: ``auto`` by :func:`~taps_ray.models.quant.auto_weights` (``dtype_requested``:
    ``target.dtype`` as given); int4 or fp16 where its kernel cannot run here is a :class:`TargetLoadError`
    naming why."""
    if requested not in WEIGHT_FORMATS:
        raise TargetLoadError(f"target.weights must be one of {', '.join(WEIGHT_FORMATS)}, got {requested!r}")
    if requested == "auto":
        return auto_weights(device, dtype, dtype_requested)
    reason = weights_unsupported(requested, device, dtype)
    if reason:
        raise TargetLoadError(f"target {name!r}: {reason}")
    return requested


def embedded_name(source: str) -> str:
    """``NAME`` of an ``embedded:NAME`` target; :class:`TargetLoadError` unless the package embeds it."""
    key = source[len(EMBEDDED_PREFIX):]
    if key not in artifacts.EMBEDDED or not key.startswith("smollm2"):
        raise TargetLoadError(f"unknown embedded target {source!r}; valid: embedded:smollm2-135m")
    return key


DEQUANTISED_RECORD = ".manifest.json"


def embedded_hf_folder(name: str) -> Path:
    """The embedded GGUF dequantised into a plain HF folder in the cache (``models/<name>``), built once.

    The record beside it (``models/<name>.manifest.json``, written atomically after the folder) holds the
    GGUF's pinned sha256 and each file's size and sha256; every call re-hashes the folder against it
    (:func:`~taps_ray.artifacts.folder_problem`: ~0.5 s for the 540 MB folder on a loaded 2-core
    machine) and rebuilds the folder from the verified GGUF, with a warning naming what differed, when
    a file is missing, extra, resized or changed, or the record is missing or names another GGUF."""
    pinned = artifacts.EMBEDDED[name]
    gguf_path = artifacts.fetch(name)
    folder = artifacts.cache_dir() / "models" / name
    record = folder.with_name(folder.name + DEQUANTISED_RECORD)
    with FileLock(str(folder) + ".lock"):
        if not folder.exists():
            log.info("converting %s to an HF folder at %s (once)", gguf_path.name, folder)
        elif (problem := _dequantised_problem(folder, record, pinned.sha256)) is None:
            return folder
        else:
            log.warning("cached dequantised %s: %s; rebuilding it from the verified %s", name, problem,
                        gguf_path.name)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        _dequantise(gguf_path, partial, name)
        files = artifacts.folder_record(partial)
        record.unlink(missing_ok=True)
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            os.replace(folder, old)
        os.replace(partial, folder)
        shutil.rmtree(old, ignore_errors=True)
        write_json(record, {"gguf": pinned.label, "gguf_sha256": pinned.sha256, "files": files})
    return folder


def _dequantised_problem(folder: Path, record: Path, gguf_sha256: str) -> str | None:
    """Why the dequantised ``folder`` does not match its ``record`` of the GGUF ``gguf_sha256``, or None."""
    try:
        saved = json.loads(record.read_text())
    except FileNotFoundError:
        return f"{record} (its record of the files) is missing"
    except (OSError, ValueError) as err:
        return f"{record} is unreadable ({err})"
    if saved.get("gguf_sha256") != gguf_sha256:
        return f"it was dequantised from a GGUF of sha256 {saved.get('gguf_sha256')}, not {gguf_sha256}"
    files = saved.get("files")
    if not isinstance(files, dict) or not {"config.json", "model.safetensors"} <= set(files):
        return f"{record} names no model files"
    return artifacts.folder_problem(folder, files)


def _dequantise(gguf_path: Path, into: Path, name: str) -> None:
    """Save the GGUF at ``gguf_path`` as a float32 HF folder (model and tokenizer) at ``into``."""
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.name_or_path = name
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)


def load_hf_model(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, object]:
    """The model (in ``dtype``) and tokenizer of an HF id or folder, or of a ``.gguf`` file; TargetLoadError naming
    the source when it cannot be loaded."""
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


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_windows(model: PreTrainedModel, name: str) -> list[int | None]:
    """Per decoder layer, the sliding window of its attention (None: full attention).

    TargetLoadError naming the family and the reason when tree verification cannot be exact on
    ``model``: a layer type other than :data:`ATTENTION_LAYER_TYPES` (chunked, linear, KV-sharing,
    ...), bidirectional attention, or sliding and full layers in a model whose forward does not
    take one mask per layer type.
    """
    config = model.config.get_text_config(decoder=True)
    family = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "use_bidirectional_attention", False):
        raise TargetLoadError(f"target {name!r} ({family}) uses bidirectional attention; only causal LMs are "
                              f"supported")
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    for i, kind in enumerate(layer_types):
        if kind not in ATTENTION_LAYER_TYPES:
            raise TargetLoadError(f"target {name!r} ({family}) has {kind!r} layers (layer {i}); tree verification "
                                  f"supports {' and '.join(ATTENTION_LAYER_TYPES)} layers only")
    windows = [kw.get("sliding_window") if kind == "sliding_attention" else None
               for kind, kw in zip(layer_types, layer_kwargs)]
    sizes = sorted({w for w in windows if w is not None})
    if len(sizes) > 1:
        raise TargetLoadError(f"target {name!r} ({family}) has sliding windows of sizes {sizes}; tree verification "
                              f"supports one window size")
    if sizes and None in windows:
        try:
            per_type = "causal_mask_mapping" in inspect.getsource(type(model.base_model).forward)
        except (OSError, TypeError):
            per_type = False
        if not per_type:
            raise TargetLoadError(f"target {name!r} ({family}) mixes sliding and full attention layers but its "
                                  f"forward takes no per-layer-type mask; a tree mask cannot respect both")
    return windows
