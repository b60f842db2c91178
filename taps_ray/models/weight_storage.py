"""How a drafter checkpoint stores its weights: as they are, or int8 per output row.

Release drafters ship as package data under a size budget (three heads sized to the embedded
target take 25 MB in bf16, 13 MB in int8). ``int8-rowwise`` stores every 2-D weight ``W`` [out, in]
as ``NAME`` int8 [out, in] plus ``NAME.scale`` float32 [out], ``W ~= NAME * NAME.scale[:, None]``,
with ``scale = max|W[row]| / 127`` and round-to-nearest; 1-D tensors (biases, norms) and integer
tensors (``draft_to_target``) are stored as they are. Loading dequantises to float32 before the
module is cast to its runtime dtype. Rounding changes only what the drafter proposes: the target
verifies every token, so outputs are exact whatever the storage.
"""

from __future__ import annotations

import torch

PLAIN = "plain"
INT8_ROWWISE = "int8-rowwise"
STORAGES = (PLAIN, INT8_ROWWISE)
SCALE_SUFFIX = ".scale"


class WeightStorageError(ValueError):
    """A checkpoint names an unknown storage, or its int8 tensors and scales do not pair up."""


def _quantizable(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and tensor.is_floating_point()


def quantize_int8_rowwise(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every 2-D float weight replaced by int8 values and a float32 row scale."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _quantizable(tensor):
            out[name] = tensor
            continue
        weight = tensor.float()
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0  # [out]
        out[name] = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        out[name + SCALE_SUFFIX] = scale.contiguous()
    return out


def dequantize(tensors: dict[str, torch.Tensor], storage: str) -> dict[str, torch.Tensor]:
    """The module state stored as ``storage`` in ``tensors`` (see the module docstring)."""
    if storage == PLAIN:
        return tensors
    if storage != INT8_ROWWISE:
        raise WeightStorageError(f"weight_storage {storage!r} is not one of {', '.join(STORAGES)}")
    scales = {name[: -len(SCALE_SUFFIX)]: t for name, t in tensors.items() if name.endswith(SCALE_SUFFIX)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype != torch.int8:
            out[name] = tensor
            continue
        scale = scales.pop(name, None)
        if scale is None or scale.shape != tensor.shape[:1]:
            raise WeightStorageError(f"int8 tensor {name!r} has no matching {name + SCALE_SUFFIX!r} of shape "
                                     f"[{tensor.shape[0]}]")
        out[name] = tensor.float() * scale.float()[:, None]
    if scales:
        raise WeightStorageError(f"scales without an int8 tensor: {sorted(scales)[:5]}")
    return out
