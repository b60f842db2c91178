"""What a verification's cost depends on, as the key of a cached cost model (:mod:`taps_ray.spec.cost`): the
device (CPU model and flags, or GPU name), dtype, threads, torch version, the target's engine and sizes."""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

import torch


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return f"{model} flags:{hashlib.sha256(' '.join(sorted(flags)).encode()).hexdigest()[:12]}"


def fingerprint(target) -> dict:
    """What a verification's cost depends on: the device (CPU model and flags, or GPU name), dtype, threads,
    torch version, the target's engine (its product format: oneDNN-packed, int4 and the row count up to which
    its int4 steps read the codes, and the revision of its code) and sizes."""
    device = target.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_identity()
    engine = getattr(target, "engine", None)
    return {"device": device.type, "hardware": where, "dtype": str(target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "engine": "hf" if engine is None else engine_label(engine), "engine_code": engine_revision(),
            "int4_max_rows": getattr(engine, "int4_max_rows", None),
            "target": {"hidden": target.hidden_size, "vocab": target.vocab_size,
                       "layers": target.config.num_hidden_layers, "embed_hash": target.fingerprint.embed_hash}}


@functools.cache
def engine_revision() -> str:
    """A hash of the source of the modules that run a verification forward (the static engine, its products,
    its attention, its C kernels, the transformers attention hook): a change to the engine's code measures the cost
    model again. Read once per process."""
    from taps_ray.models import attention, compiled, decode_attention, engine, graphs, native, quant

    digest = hashlib.sha256()
    for module in (engine, quant, attention, graphs, compiled, decode_attention):
        digest.update(Path(str(module.__file__)).read_bytes())
    for source in (native.SOURCE, native.ATTENTION_SOURCE):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def engine_label(engine) -> str:
    """``static``, ``static-packed`` (oneDNN-prepacked dense products), ``static-int4`` (4-bit layer weights) or
    ``static-fp16`` (half-precision weights through fbgemm); ``-graphs`` appended where steps run as CUDA graphs,
    ``-compiled`` where they run compiled on CPU."""
    graphs = "-graphs" if getattr(engine, "graphs", None) is not None else ""
    graphs += "-compiled" if getattr(engine, "compiled", None) is not None else ""
    if engine.weights in ("int4", "fp16", "q4q8"):
        return f"static-{engine.weights}{graphs}"
    return f"static{'-packed' if engine.packed else ''}{graphs}"
