"""A tiny random Llama target saved as an HF folder (with a word-level tokenizer) and feature sets
written straight into the feature cache, so ``taps train`` runs in seconds without ``taps prepare``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

from taps_ray.config import ExperimentConfig, load_config
from taps_ray.data.contamination import prompt_hash, write_feature_prompts
from taps_ray.data.feature_sets import (
    FORMAT_VERSION,
    LAST,
    MANIFEST,
    feature_kind,
    feature_set_path,
    stored_layers,
)
from taps_ray.models.target import TargetModel
from tests.conftest import make_tiny_target

VOCAB = 128
HIDDEN = 32


def save_tiny_target(folder: Path, layers: int = 2) -> TargetModel:
    """Save a seeded tiny Llama of ``layers`` layers and a word-level tokenizer to ``folder``; return it loaded
    from there."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    target = make_tiny_target(7, vocab_size=VOCAB, hidden_size=HIDDEN, layers=layers)
    target.model.save_pretrained(folder)
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    from taps_ray.config import TargetConfig

    return TargetModel.load(TargetConfig(model=str(folder), device="cpu", dtype="float32"))


def write_features(cfg: ExperimentConfig, target: TargetModel, name: str, rows: int, seed: int,
                   token_range: tuple[int, int]) -> Path:
    """A complete feature set of ``rows`` random conversations (prompt, then an assistant span
    ending in EOS; row ``i``'s prompt recorded as ``"<name> question <i>"``) in the cache folder
    ``cfg`` and ``target`` resolve to, storing the hidden states of the kind ``cfg`` gives the dataset
    (:func:`~taps_ray.data.feature_sets.feature_kind`)."""
    kind = feature_kind(cfg, name)
    layers = stored_layers(kind, target.final_layer)
    g = torch.Generator().manual_seed(seed)
    out = feature_set_path(cfg, name, target.fingerprint.to_dict())
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for row_id in range(rows):
        length = int(torch.randint(12, 40, (1,), generator=g))
        prompt = int(torch.randint(3, 8, (1,), generator=g))
        ids = torch.randint(*token_range, (length,), generator=g)
        ids[0], ids[-1] = 0, 1
        mask = torch.zeros(length, dtype=torch.int8)
        mask[prompt:] = 1
        hidden = target.hidden_states(ids[None], layers=layers)[0].to(torch.bfloat16)
        records.append({"row_id": row_id, "input_ids": ids.tolist(), "loss_mask": mask.tolist(), "length": length,
                        "hidden": hidden.contiguous().view(torch.int16).numpy().tobytes()})
    schema = pa.schema([("row_id", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("length", pa.int32()), ("hidden", pa.binary())])
    half = len(records) // 2
    for i, part in enumerate((records[:half], records[half:])):
        pq.write_table(pa.Table.from_pylist(part, schema=schema), out / f"part-{i}.parquet")
    manifest = {"dataset": name, "origin": f"synthetic {name}", "rows": rows,
                "tokens": sum(r["length"] for r in records), "target": target.fingerprint.to_dict(),
                "format": FORMAT_VERSION, **({} if kind == LAST else {"layers": list(layers)})}
    write_feature_prompts(out, [prompt_hash(f"{name} question {row_id}") for row_id in range(rows)])
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


TRAIN = {"epochs": 2, "batch_size": 4, "lr": 2e-3, "warmup_steps": 2, "checkpoint_every": 3, "log_every": 2,
         "heldout_rows": 6, "eval_depth": 3, "max_failures": 2, "threads": 1}


def write_config(tmp_path: Path, target_dir: Path, variants: list[dict], **sections) -> Path:
    raw = {
        "name": "tiny",
        "output_dir": str(tmp_path / "runs"),
        "target": {"model": str(target_dir), "device": "cpu", "dtype": "float32"},
        "data": {"datasets": {n: {"domain": n, "alternatives": [{"kind": "jsonl", "path": f"/missing/{n}.jsonl"}]}
                              for n in ("math", "chat")},
                 "features": {"max_len": 64}},
        "mixtures": {"math-only": {"counts": {"math": 24}}, "mixed": {"ratio": {"math": 0.5, "chat": 0.5}, "total": 24}},
        "drafter": {"draft_vocab_size": 48, "seed": 3},
        "train": TRAIN,
        "variants": variants,
        **sections,
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def tiny_experiment(tmp_path: Path, variants: list[dict], layers: int = 2, **sections) -> tuple[Path, TargetModel]:
    """Target folder (``layers`` layers), features for ``math`` and ``chat`` under ``$TAPS_CACHE`` (must point
    into ``tmp_path``) and a config file; returns (config path, target)."""
    assert str(os.environ.get("TAPS_CACHE", "")).startswith(str(tmp_path))
    target = save_tiny_target(tmp_path / "target", layers)
    path = write_config(tmp_path, tmp_path / "target", variants, **sections)
    cfg = load_config(path)
    write_features(cfg, target, "math", 36, seed=1, token_range=(2, 70))
    write_features(cfg, target, "chat", 36, seed=2, token_range=(40, VOCAB))
    return path, target


def drafter_tensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))
