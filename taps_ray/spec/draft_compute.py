"""How drafting runs the drafter and its LM head (:class:`DraftCompute`): the drafter's forward over its
own cache and the draft-vocabulary log-probabilities of its outputs, directly (:data:`DIRECT`) or through
a batcher that several sessions drafting at once share (:class:`taps_ray.spec.batch.DraftBatcher`), with
the same results; the LM-head rows of a drafter's draft vocabulary, computed once per drafter and head.

Shapes: ``n`` new positions, ``P`` cached positions, ``H`` hidden size, ``V`` draft vocabulary.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from taps_ray.models.drafter import DraftHead
from taps_ray.models.engine import Linear, can_pack
from taps_ray.models.quant import GROUP, HalfLinear, Int4Linear, Q4Q8Linear, q4q8_unsupported, quantize_rtn


class DraftCompute:
    """How :func:`~taps_ray.spec.tree.draft_tree` runs the drafter and its LM head: directly (this class,
    :data:`DIRECT`), or through a batcher that several sessions drafting at once share
    (:class:`taps_ray.spec.batch.DraftBatcher`), with the same results."""

    def forward(self, drafter: DraftHead, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: DynamicCache, mask: torch.Tensor | None) -> torch.Tensor:
        """``drafter(embeds [1, n, H], features [1, n, H], positions [1, n], cache, mask [1, 1, n, P + n] or
        None)`` -> [1, n, H]; ``cache`` is extended by n entries."""
        return drafter(embeds, features, positions, cache, mask)

    def log_probs(self, head: DraftHeadProduct, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`draft_log_probs` of ``hidden`` [n, H] under ``head``."""
        return draft_log_probs(head, hidden)


DIRECT = DraftCompute()


INT4_HEAD_ROWS = 4
INT4_ROW_MULTIPLE = 16
KINDS = ("int4", "q4q8", "packed", "half", "dense")


class DraftHeadProduct:
    """``hidden [n, H] -> logits [n, V]`` (float32) under the rows [V, H] of the target's LM head that make a
    drafter's vocabulary, read in the format that is fastest for the few rows drafted at once:

    - ``int4``: 4-bit codes of the rows (round to nearest, groups of 32), for a target that reads its layers as
      int4 on CPU; run in chunks of at most :data:`INT4_HEAD_ROWS` rows. Decoding reads the head right after a
      target step has pushed it out of the CPU's caches; read so, an 8192-row draft vocabulary took 0.34 / 0.48 ms
      at 1 / 3 rows as int4 codes against 0.86 / 0.79 ms packed (docs/BENCHMARKS.md, "thirty-second session");
    - ``q4q8``: the same 4-bit codes times activations quantized to int8 per group of 32 (the C kernel of a q4q8
      target, :class:`~taps_ray.models.quant.Q4Q8Linear`): 0.16 / 0.29 ms at 1 / 3 rows read after a flush of the
      caches, 0.05 / 0.07 ms warm, against int4's 0.32 / 0.35 and 0.15 / 0.21 ms (docs/BENCHMARKS.md,
      "thirty-fifth session");
    - ``packed``: oneDNN's product on a prepacked copy (:class:`~taps_ray.models.engine.Linear`), where the engine
      packs its own products (CPU float32, or bf16 with native bf16): 1.8-2.4x a bf16 ``mm`` at 1-8 rows;
    - ``half``: a :class:`~taps_ray.models.quant.HalfLinear`, for ``target.weights: fp16`` where the q4q8 kernel
      cannot run;
    - ``dense``: ``rows @ hidden^T``.

    The head only proposes: a format changes which tokens are drafted, never which are accepted. ``int4``,
    ``q4q8``, ``packed`` and ``half`` compute each row apart from the others in the call, so rows batched with other
    sessions' rows equal the rows drafted alone; ``dense`` leaves that to the BLAS (float32 ``mm`` on CPU sums a
    lone row in another order).
    """

    def __init__(self, rows: torch.Tensor, kind: str):
        if kind not in KINDS:
            raise ValueError(f"draft head kind must be {', '.join(KINDS[:-1])} or {KINDS[-1]}, got {kind!r}")
        if rows.is_inference():  # gathered under inference mode: the products track their weight's version
            with torch.inference_mode(False):
                rows = rows.clone()
        if kind in ("int4", "q4q8") and rows.shape[1] % GROUP:
            kind = "packed" if can_pack(rows.device, rows.dtype) else "dense"
        self.rows, self.kind = rows, kind
        self._product: Linear | Int4Linear | Q4Q8Linear | HalfLinear | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickles and copies without the packed product (made again on first use)."""
        return {"rows": self.rows, "kind": self.kind, "_product": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _made(self) -> Linear | Int4Linear | Q4Q8Linear | HalfLinear:
        """The product, made once (sessions drafting at once on their own threads share one)."""
        if self._product is not None:
            return self._product
        with self._lock:
            if self._product is not None:
                return self._product
            if self.kind in ("int4", "q4q8"):
                padded = F.pad(self.rows, (0, 0, 0, -self.rows.shape[0] % INT4_ROW_MULTIPLE))
                codes = quantize_rtn(padded)
                self._product = (Int4Linear(codes, None, self.rows.dtype, padded) if self.kind == "int4"
                                 else Q4Q8Linear(codes, None, padded))
            elif self.kind == "packed":
                self._product = Linear(self.rows, None, pack=True)
            else:
                self._product = HalfLinear(self.rows, None)
            return self._product

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kind == "dense":
            return (self.rows @ hidden.to(self.rows.dtype).T).T.float().contiguous()
        product = self._made()
        if self.kind == "half":
            return product(hidden.float())
        hidden = hidden.to(self.rows.dtype)
        if self.kind == "q4q8":
            return product(hidden)[:, :self.rows.shape[0]].float()
        if self.kind != "int4":
            return product(hidden).float()
        parts = [product(part) for part in hidden.split(INT4_HEAD_ROWS)]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        return logits[:, :self.rows.shape[0]].float()


def draft_head_kind(target) -> str:
    """The :class:`DraftHeadProduct` kind for drafting against ``target``: its weights' format where it has a
    low-bit one (``int4``, ``q4q8``); for an fp16 target ``q4q8`` where the kernel runs (drafting needs no
    bitwise agreement with the target: on the emulated AVX2 kind a drafting call took 21-31% less than on half
    weights, docs/BENCHMARKS.md, thirty-fifth session), else ``half``; ``packed`` where its engine packs its
    products; else ``dense``."""
    weights = getattr(target, "weights", "dense")
    if weights in ("int4", "q4q8"):
        return weights
    if weights == "fp16":
        device, dtype = getattr(target, "device", torch.device("cpu")), getattr(target, "dtype", torch.float32)
        return "q4q8" if q4q8_unsupported(device, dtype) is None else "half"
    engine = getattr(target, "engine", None)
    return "packed" if engine is not None and engine.packed else "dense"


def draft_head_rows(drafter: DraftHead, weight: torch.Tensor, kind: str = "dense") -> DraftHeadProduct:
    """The :class:`DraftHeadProduct` of ``drafter``'s draft vocabulary in the target head ``weight`` [V, H] (the
    whole of ``weight`` for the whole vocabulary), of ``kind`` (:func:`draft_head_kind`); made once per drafter,
    head and kind and shared by its sessions."""
    cached: tuple[torch.Tensor, dict[str, DraftHeadProduct]] | None = drafter.__dict__.get("_head_rows")
    if cached is None or cached[0] is not weight:
        cached = (weight, {})
        drafter.__dict__["_head_rows"] = cached
    if kind not in cached[1]:
        rows = weight if drafter.draft_to_target is None else weight[drafter.draft_to_target]
        cached[1][kind] = DraftHeadProduct(rows.detach(), kind)
    return cached[1][kind]


def draft_log_probs(head: DraftHeadProduct, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft log-probs [n, V], their entropies [n] and log-normalisers [n] from drafter outputs
    ``hidden`` [n, H] under the draft-vocabulary LM ``head`` (:func:`draft_head_rows`)."""
    logits = head(hidden)
    logp = torch.log_softmax(logits, dim=-1)
    return logp, -(logp.exp() * logp).sum(-1), logits.amax(-1) - logp.amax(-1)
