"""EAGLE-3 checkpoint folders (the SpecForge / SafeAILab EAGLE-3 layout) in and out of
:class:`~taps_ray.models.eagle3.Eagle3Head`.

An EAGLE-3 folder holds ``config.json`` (a one-layer Llama config plus the EAGLE-3 fields) and
``model.safetensors`` with ``fc.weight`` [H, 3H], ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v read
2H: the token embedding and the feature), ``midlayer.mlp.{gate,up,down}_proj.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``, ``norm.weight``,
``lm_head.weight`` [V_draft, H], and for a reduced draft vocabulary ``d2t`` [V_draft] (int64 offsets: draft
id i is target id ``i + d2t[i]``) and ``t2d`` [V] (bool: the target ids the draft vocabulary holds). Our
parameter names are these names; the LM head is the target's rows at the draft vocabulary (ours drafts
through the target's own head), written out because the engines load one.

The engines read the same tensors but differ in the config:

- ``sglang`` (SpecForge's layout): ``architectures: ["LlamaForCausalLMEagle3"]``, the fused layers under
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` as 0-based decoder-layer outputs (SGLang captures the
  input of layer id + 1). Its ``qkv_proj`` has no bias, and it skips any name it does not know without a
  word, so a drafter with attention biases is refused rather than written.
- ``vllm``: ``architectures: ["Eagle3LlamaForCausalLM"]``, top-level ``eagle_aux_hidden_state_layer_ids`` in
  vLLM's count (id j is the input of decoder layer j: our output layer + 1).

Both need ``tie_word_embeddings: false`` and ``draft_vocab_size`` (or they would use the embedding as a
full-vocabulary head). The config also carries a ``taps`` block (target fingerprint, seed, metadata) so
that export -> import gives the same tensors bit for bit.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from taps_ray.models.drafter import CONFIG_NAME, WEIGHTS_NAME, DrafterLoadError, check_draft_vocabulary
from taps_ray.models.eagle_format import (
    TRAINED_PROMPTS_NAME,
    EagleExportError,
    check_replaceable,
    publish,
    read_eagle_tensors,
)
from taps_ray.models.target import TargetFingerprint

ENGINES: dict[str, list[str]] = {"sglang": ["LlamaForCausalLMEagle3"], "vllm": ["Eagle3LlamaForCausalLM"]}
EXPORT_FILES = frozenset({CONFIG_NAME, WEIGHTS_NAME, TRAINED_PROMPTS_NAME})
MAP_KEYS = ("d2t", "t2d")
_CONFIG_NOISE = ("id2label", "label2id", "_name_or_path", "output_hidden_states", "output_attentions", "return_dict",
                 "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "dtype", "bos_token_id",
                 "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Eagle3Export:
    """What :func:`export_eagle3` wrote: the folder, the engine and the aux layer ids in its config."""

    path: Path
    engine: str
    aux_layer_ids: list[int]


def aux_layer_ids(aux: tuple[int, ...], engine: str) -> list[int]:
    """The config's aux layer ids for ``engine`` from our 0-based decoder-layer outputs ``aux``."""
    return [int(a) for a in aux] if engine == "sglang" else [int(a) + 1 for a in aux]


def aux_from_config(meta: dict) -> tuple[int, ...] | None:
    """Our 0-based decoder-layer outputs from an EAGLE-3 ``config.json``: SGLang's nested ids as they are,
    vLLM's top-level ids minus one; None when it names none (the engines' default then applies)."""
    nested = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(i) for i in nested)
    top = meta.get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) - 1 for i in top) if top else None


def eagle3_config(head, fingerprint: TargetFingerprint, engine: str, dtype: torch.dtype) -> dict:
    """The ``config.json`` of an export (see the module doc)."""
    cfg = head.config.to_dict()
    for noise in _CONFIG_NOISE:
        cfg.pop(noise, None)
    rope = dict(cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    ids = aux_layer_ids(head.aux, engine)
    cfg.update(
        architectures=list(ENGINES[engine]),
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        draft_vocab_size=head.draft_vocab_size,
        target_hidden_size=head.config.hidden_size,
        bias=False,
        rope_theta=rope.get("rope_theta", 10000.0),
        rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    if engine == "sglang":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    else:
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
    cfg["taps"] = {"format": "eagle3", "engine": engine, "target": fingerprint.to_dict(), "seed": head.seed,
                   "metadata": head.metadata, "aux_layers": list(head.aux), "target_layers": head.target_layers,
                   "lm_head": "target"}
    return cfg


def eagle3_tensors(head, lm_head_weight: torch.Tensor, engine: str) -> dict[str, torch.Tensor]:
    """The EAGLE-3 tensors of ``head`` for ``engine``: its own weights, the LM head rows [V_draft, H] of the
    target's ``lm_head_weight`` [V, H] and, for a reduced vocabulary, ``d2t`` / ``t2d``."""
    if engine not in ENGINES:
        raise EagleExportError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    state = {k: v.detach().contiguous().cpu() for k, v in head.trainable_state().items()}
    biases = sorted(k for k in state if k.endswith(".bias"))
    if biases and engine == "sglang":
        raise EagleExportError(f"the drafter has {', '.join(biases)}; SGLang's EAGLE-3 layer has no such biases and "
                               f"would skip them without a word: export with --engine vllm")
    vocab = head.config.vocab_size
    if lm_head_weight.shape != (vocab, head.config.hidden_size):
        raise EagleExportError(f"the target's LM head is {list(lm_head_weight.shape)}, the drafter expects "
                               f"[{vocab}, {head.config.hidden_size}]: is it this drafter's target?")
    d2t = head.draft_to_target
    rows = lm_head_weight if d2t is None else lm_head_weight[d2t.to(lm_head_weight.device)]
    dtype = state["fc.weight"].dtype
    out = {**state, "lm_head.weight": rows.detach().to("cpu", dtype).contiguous()}
    if d2t is not None:
        d2t = d2t.detach().cpu().to(torch.int64)
        out["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()
        out["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, d2t, True)
    return out


def export_eagle3(head, out: str | Path, fingerprint: TargetFingerprint, lm_head_weight: torch.Tensor,
                  engine: str = "sglang", source: Path | None = None) -> Eagle3Export:
    """Write the EAGLE-3 ``head`` as a folder for ``engine`` at ``out`` (atomically, via ``.partial``);
    ``lm_head_weight`` [V, H] is its target's LM head. ``out`` may hold an earlier export (it is replaced) but
    nothing else; ``source``, the drafter's own folder, lends its ``trained_prompts.json``."""
    if getattr(head, "algorithm", None) != "eagle3":
        raise EagleExportError(f"--format eagle3 takes an EAGLE-3 drafter, this one is "
                               f"{getattr(head, 'algorithm', type(head).__name__)}: use --format eagle")
    out = Path(out)
    check_replaceable(out, EXPORT_FILES)
    tensors = eagle3_tensors(head, lm_head_weight, engine)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / WEIGHTS_NAME), metadata={"format": "pt"})
    config = eagle3_config(head, fingerprint, engine, tensors["fc.weight"].dtype)
    (partial / CONFIG_NAME).write_text(json.dumps(config, indent=1, default=str))
    publish(partial, out, source)
    return Eagle3Export(path=out, engine=engine, aux_layer_ids=aux_layer_ids(head.aux, engine))


def load_eagle3(directory: str | Path, target_config, fingerprint: TargetFingerprint,
                lm_head_weight: torch.Tensor | None = None):
    """An :class:`~taps_ray.models.eagle3.Eagle3Head` from an EAGLE-3 folder for the target of ``target_config``
    / ``fingerprint``.

    The head drafts through the target's LM head, so the folder's ``lm_head.weight`` must be the target's rows
    at its draft vocabulary: taken as such for our own exports (their ``taps`` block says so), compared with
    ``lm_head_weight`` [V, H] otherwise (a checkpoint with a head of its own, or none to compare with, is a
    :class:`DrafterLoadError` that says so). Sizes, aux layers and the vocabulary map are checked against the
    target; the head is float32 on CPU."""
    from taps_ray.models.eagle3 import Eagle3Head

    directory = Path(directory)
    where = f"EAGLE-3 drafter {str(directory)!r}"
    try:
        meta = json.loads((directory / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DrafterLoadError(f"{where}: unreadable {CONFIG_NAME}: {err}") from err
    tensors = read_eagle_tensors(directory)
    taps = meta.get("taps") or {}
    if taps.get("target") and (problem := fingerprint.mismatch(taps["target"])):
        raise DrafterLoadError(f"{where} was trained for another target: {problem}")
    vocab = fingerprint.vocab_size
    d2t = _draft_to_target(tensors, vocab, where)
    try:
        head = Eagle3Head(target_config, draft_to_target=d2t, seed=int(taps.get("seed", 0)),
                          metadata=dict(taps.get("metadata") or {}), aux=aux_from_config(meta))
    except ValueError as err:
        raise DrafterLoadError(f"{where}: {err}") from None
    head_rows = tensors.pop("lm_head.weight", None)
    if taps.get("lm_head") != "target":
        _check_head_rows(head_rows, lm_head_weight, d2t, where)
    tensors.pop("embed_tokens.weight", None)
    expected = head.trainable_state()
    wrong = [f"{k} {list(v.shape)} (expected {list(expected[k].shape)})" for k, v in tensors.items()
             if k in expected and v.shape != expected[k].shape]
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if wrong or missing or unexpected:
        raise DrafterLoadError(f"{where}: weights do not fit an EAGLE-3 head of this target: "
                               + "; ".join(part for part in (f"wrong shapes: {', '.join(wrong)}" if wrong else "",
                                                             f"missing: {', '.join(missing)}" if missing else "",
                                                             f"unexpected: {', '.join(unexpected)}" if unexpected else "")
                                           if part))
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return head.float().eval()


def _draft_to_target(tensors: dict[str, torch.Tensor], vocab: int, where: str) -> torch.Tensor | None:
    """The draft vocabulary [V_draft] from ``d2t`` offsets (popping ``d2t`` / ``t2d``), None without one;
    a map that is not one-to-one into the target vocabulary, or a ``t2d`` that disagrees, is an error."""
    offsets, mask = (tensors.pop(k, None) for k in MAP_KEYS)
    if offsets is None:
        return None
    try:
        d2t = check_draft_vocabulary(offsets.to(torch.int64) + torch.arange(offsets.numel()), vocab)
    except ValueError as err:
        raise DrafterLoadError(f"{where}: bad d2t: {err}") from None
    if mask is not None and (mask.numel() != vocab or not torch.equal(mask.bool().nonzero().squeeze(1),
                                                                      d2t.sort().values)):
        raise DrafterLoadError(f"{where}: t2d does not mark exactly the {d2t.numel()} target ids d2t maps to")
    return d2t


def _check_head_rows(rows: torch.Tensor | None, lm_head_weight: torch.Tensor | None, d2t: torch.Tensor | None,
                     where: str) -> None:
    """Refuse a folder whose ``lm_head.weight`` is not the target's rows at its draft vocabulary."""
    if rows is None:
        return
    if lm_head_weight is None:
        raise DrafterLoadError(f"{where} carries an LM head of its own ({list(rows.shape)}) and no record that it "
                               f"is the target's; taps_ray's EAGLE-3 heads draft through the target's LM head, so "
                               f"import it with the target at hand to compare them")
    expected = lm_head_weight if d2t is None else lm_head_weight[d2t]
    gap = (rows.float() - expected.float().cpu()).abs().max() if rows.shape == expected.shape else None
    bound = torch.finfo(rows.dtype).eps * float(expected.abs().max())
    if gap is None or float(gap) > bound:
        what = f"{list(rows.shape)} vs {list(expected.shape)}" if gap is None else f"largest difference {float(gap):.3g}"
        raise DrafterLoadError(f"{where}: its lm_head.weight is not the target's LM head at its draft vocabulary "
                               f"({what}); taps_ray's EAGLE-3 heads draft through the target's own LM head, so a "
                               f"trained head of its own cannot be imported")

