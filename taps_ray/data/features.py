"""Target features: chat-template tokenization, loss masks, one teacher-forced target pass,
Parquet shards written by Ray Data target actors, cached by content key.

The cache's format and reading it back are :mod:`taps_ray.data.feature_sets`. Prompt-only sources
are first answered by the target (self-distillation, :mod:`taps_ray.data.regeneration` keeps the
answers). A feature set prepared before ``prompts.json`` existed gets one on its next ``prepare``
(from the source's conversations).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from taps_ray.config import ExperimentConfig, RegenerationConfig, SamplingConfig, TargetConfig, TreeConfig
from taps_ray.data.contamination import FEATURE_PROMPTS, conversation_hash, write_feature_prompts
from taps_ray.data.feature_sets import (
    FORMAT_VERSION,
    LAST,
    MANIFEST,
    FeatureCacheError,
    feature_kind,
    feature_set_path,
    open_feature_set,
    stored_layers,
)
from taps_ray.runstate import folder_lock, write_json
from taps_ray.runtime.cluster import quiet_ray_data
from taps_ray.spec.cost import TreeBudget

log = logging.getLogger(__name__)


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` with the chat template; return the text and each assistant turn's
    character span (the turn's content plus the template's end-of-turn marker).

    Spans come from rendering growing prefixes (with and without the generation prompt), so
    no template-specific offsets are assumed.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
        end = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
        if not text.startswith(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)):
            raise ValueError("chat template is not prefix-stable; cannot derive assistant spans")
        body = text[start:end]
        eos = tokenizer.eos_token or ""
        cut = body.rfind(eos) + len(eos) if eos and eos in body else len(body.rstrip())
        spans.append((start, start + cut))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> TokenizedConversation:
    """Token ids and loss mask (1 on assistant tokens) of one conversation, truncated to ``max_len``."""
    text, spans = assistant_char_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    starts = np.array([s for s, _ in encoded["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.int8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    truncated = len(ids) > max_len
    return TokenizedConversation(ids[:max_len], mask[:max_len].tolist(), truncated)


class _TargetActor:
    """Ray Data callable class holding one target model (loaded once per actor); prints its progress
    (``label``: rows done of ``total_rows``, tokens, tokens/s) at every tenth of ``total_rows``."""

    def __init__(self, target_cfg: dict, label: str = "", total_rows: int = 0):
        from taps_ray.models.target import TargetModel

        cfg = TargetConfig.model_validate(target_cfg)
        if cfg.threads is None and torch.device("cuda" if torch.cuda.is_available() else "cpu").type == "cpu":
            torch.set_num_threads(max(1, os.cpu_count() or 1))
        self.target = TargetModel.load(cfg)
        self.label, self.total_rows = label, total_rows
        self.rows = self.tokens = self.reported = 0
        self.started = time.perf_counter()

    def _progress(self, rows: int, tokens: int) -> None:
        self.rows, self.tokens = self.rows + rows, self.tokens + tokens
        tenth = 10 * self.rows // max(1, self.total_rows)
        if self.label and tenth > self.reported:
            self.reported = tenth
            rate = self.tokens / max(1e-9, time.perf_counter() - self.started)
            print(f"{self.label}: {self.rows}/{self.total_rows} rows, {self.tokens} tokens, {rate:.0f} tokens/s",
                  flush=True)


class FeatureActor(_TargetActor):
    """Batch of tokenized rows -> the same rows plus ``hidden`` bf16 bytes (teacher forced): the hidden states
    of ``kind`` (:func:`~taps_ray.data.feature_sets.stored_layers`), [T, layers * H] per row (``layers`` None:
    the last hidden state alone)."""

    layers: tuple[int, ...] | None = None

    def __init__(self, target_cfg: dict, label: str = "", total_rows: int = 0, kind: str = LAST):
        super().__init__(target_cfg, label, total_rows)
        self.layers = stored_layers(kind, self.target.final_layer)

    def __call__(self, batch):
        """``batch``: pyarrow table with row_id, input_ids, loss_mask -> the same plus length, hidden."""
        import pyarrow as pa

        id_lists = batch.column("input_ids").to_pylist()
        lengths = [len(ids) for ids in id_lists]
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, row in enumerate(id_lists):
            ids[i, : lengths[i]] = torch.tensor(row)
            attn[i, : lengths[i]] = 1
        hidden = self.target.hidden_states(ids, attn, self.layers).to(torch.bfloat16).cpu()
        blobs = [hidden[i, : lengths[i]].contiguous().view(torch.int16).numpy().tobytes() for i in range(len(lengths))]
        self._progress(len(lengths), sum(lengths))
        return pa.table({
            "row_id": batch.column("row_id").cast(pa.int64()),
            "input_ids": pa.array(id_lists, type=pa.list_(pa.int32())),
            "loss_mask": batch.column("loss_mask").cast(pa.list_(pa.int8())),
            "length": pa.array(lengths, type=pa.int32()),
            "hidden": pa.array(blobs, type=pa.binary()),
        })


RECHECK_EVERY = 8
"""Regeneration batches between two tries of the mode (drafting or plain) last measured slower."""


class RegenerateActor(_TargetActor):
    """Batch of prompts (``messages`` as JSON) -> ``response`` text generated by the target.

    The batch is decoded together by our own decoder (:func:`~taps_ray.spec.batch.generate_together`:
    one verification forward for every request's step) with the regeneration drafter
    (:attr:`RegenerationConfig.drafter`) and one cost-model budget, which sizes each step's tree for the
    batch and decodes plainly where drafting does not pay; or, where whole batches decode faster plainly (a
    wide batch on a compute-bound CPU), without the drafter: :meth:`drafting` picks per batch by the tokens per
    second measured on this actor's batches. Lossless either way: the answers are the target's own (greedy, or
    sampled with a seed per row)."""

    def __init__(self, target_cfg: dict, regeneration: dict, label: str = "", total_rows: int = 0):
        super().__init__(target_cfg, label, total_rows)
        self.regen = RegenerationConfig.model_validate(regeneration)
        self.drafter = regeneration_drafter(self.target, self.regen.drafter)
        self.budget = TreeBudget()
        self.rates: dict[bool, float] = {}  # drafting or not -> tokens/s of its last batch
        self.batches = 0

    def drafting(self) -> bool:
        """Whether the next batch drafts: with a drafter, the first batch does and the second does not; then the
        mode whose last batch decoded more tokens per second, the other every :data:`RECHECK_EVERY`-th batch."""
        if self.drafter is None:
            return False
        untried = [mode for mode in (True, False) if mode not in self.rates]
        if untried:
            return untried[0]
        best = max(self.rates, key=lambda mode: self.rates[mode])
        return not best if self.batches % RECHECK_EVERY == 0 else best

    def observe(self, drafting: bool, tokens_per_s: float) -> None:
        """Record a batch's tokens per second; say which mode won once both were measured."""
        first = len(self.rates) == 1 and drafting not in self.rates
        self.rates[drafting] = tokens_per_s
        self.batches += 1
        if first and self.label:
            faster = "with the drafter" if self.rates[True] >= self.rates[False] else "plainly"
            print(f"{self.label}: {self.rates[True]:.0f} tokens/s with the drafter, {self.rates[False]:.0f} "
                  f"plainly batched: decoding {faster} (the other again every {RECHECK_EVERY} batches)", flush=True)

    def _strategy(self, drafting: bool = True):
        from taps_ray.spec.protocol import SingleStrategy, VanillaStrategy

        if self.drafter is None or not drafting:
            return VanillaStrategy()
        strategy = SingleStrategy(self.drafter, TreeConfig())
        strategy.tree_budget = self.budget
        return strategy

    def __call__(self, batch: dict) -> dict:
        from taps_ray.spec.batch import generate_together
        from taps_ray.spec.decoder import prompt_ids

        prompts = [prompt_ids(self.target, json.loads(m)) for m in batch["messages"]]
        samplings = None
        if self.regen.temperature > 0:
            samplings = [SamplingConfig(temperature=self.regen.temperature, seed=self.regen.seed + int(i))
                         for i in batch["row_id"]]
        drafting = self.drafting()
        start = time.perf_counter()
        results, _ = generate_together(self.target, prompts, [self._strategy(drafting) for _ in prompts], samplings,
                                       max_batch=len(prompts), wait_s=0.05, max_new_tokens=self.regen.max_new_tokens,
                                       collect_entropy=False)
        texts, tokens = [r.text for r in results], sum(len(r.token_ids) for r in results)
        self.observe(drafting, tokens / max(time.perf_counter() - start, 1e-9))
        self._progress(len(texts), tokens)
        return {"row_id": batch["row_id"], "messages": batch["messages"], "response": np.array(texts, dtype=object)}


def regeneration_drafter(target, source: str | None):
    """The drafter that speeds regeneration up: ``source`` (a folder or ``release:NAME``), the shipped
    ``release:math`` drafter when ``auto`` and it fits ``target``, or None (plain decoding)."""
    from taps_ray.drafter_sources import default_release_drafter, resolve_drafter_dir
    from taps_ray.models.drafter import DrafterLoadError
    from taps_ray.spec.decoder import load_drafter

    if source is None:
        return None
    auto = source == "auto"
    if auto:
        source = default_release_drafter("math")
        if source is None:
            return None
    try:
        return load_drafter(target, str(resolve_drafter_dir(source)))
    except DrafterLoadError:
        if auto:
            return None
        raise


@dataclass
class PrepareResult:
    dataset: str
    path: str
    cache_hit: bool
    origin: str
    rows: int
    tokens: int
    loss_tokens: int
    megabytes: float
    seconds: float
    skipped: dict = field(default_factory=dict)
    regenerated: int = 0
    truncated: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 and not self.cache_hit else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)}


def _actor_options() -> dict:
    if torch.cuda.is_available():
        return {"num_gpus": 1}
    return {"num_cpus": 1}


def _num_actors(cfg: ExperimentConfig) -> int:
    if cfg.data.features.num_actors:
        return cfg.data.features.num_actors
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def regeneration_prompt(conversation: list[dict]) -> list[dict]:
    """The turns the target answers when a conversation is regenerated: its first system/user turns."""
    return [m for m in conversation if m["role"] != "assistant"][:2]


def drop_prompts_without_room(tokenizer, conversations: list[list[dict]], max_len: int) -> tuple[list[list[dict]], int]:
    """``conversations`` whose regeneration prompt leaves room for a response within ``max_len``
    tokens, and how many were dropped. A dropped one could add no assistant token to a feature row
    (its response would be truncated away), so it is not worth a generation."""
    texts = [tokenizer.apply_chat_template(regeneration_prompt(c), tokenize=False, add_generation_prompt=True)
             for c in conversations]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    kept = [c for c, n in zip(conversations, lengths, strict=True) if n < max_len]
    return kept, len(conversations) - len(kept)


def _regenerate(cfg: ExperimentConfig, conversations: list[list[dict]], target, label: str = "") -> list[list[dict]]:
    """Each conversation's prompt (its first system/user turns) answered by the target.

    Responses already in the :class:`~taps_ray.data.regeneration.ResponseStore` are reused; the
    rest are decoded by Ray Data target actors (prompts sorted by length, so a batch pads little)
    and stored as each batch arrives, so an interrupted run loses at most the batches in flight.
    """
    from taps_ray.data.regeneration import ResponseStore, prompt_key

    regen = cfg.data.features.regeneration
    prompts = [regeneration_prompt(conv) for conv in conversations]
    keys = [prompt_key(p) for p in prompts]
    store = ResponseStore.open(target.fingerprint.to_dict(), f"{target.device.type}:{target.describe()['dtype']}", regen)
    missing = sorted({k: i for i, k in enumerate(keys) if store.get(k) is None}.values(),
                     key=lambda i: len(json.dumps(prompts[i])))
    log.info("%s: %d of %d responses already in %s; generating %d", label, len(keys) - len(missing), len(keys),
             store.path, len(missing))
    if missing:
        import ray

        quiet_ray_data()
        items = [{"row_id": i, "messages": json.dumps(prompts[i])} for i in missing]
        ds = ray.data.from_items(items).map_batches(
            RegenerateActor,
            fn_constructor_kwargs={"target_cfg": cfg.target.model_dump(), "regeneration": regen.model_dump(),
                                   "label": f"{label}: regenerating", "total_rows": len(items)},
            batch_size=regen.batch_size,
            compute=ray.data.ActorPoolStrategy(size=_num_actors(cfg)),
            **_actor_options(),
        )
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            store.add([(keys[int(i)], str(r).strip()) for i, r in zip(batch["row_id"], batch["response"], strict=True)])
    return [prompt + [{"role": "assistant", "content": store.get(key)}]
            for prompt, key in zip(prompts, keys, strict=True)]


def _write_features(cfg: ExperimentConfig, rows: list[dict], out_dir: Path, label: str = "features",
                    kind: str = LAST) -> None:
    import ray

    quiet_ray_data()
    rows = sorted(rows, key=lambda r: len(r["input_ids"]))
    batch_rows = max(1, cfg.data.features.batch_tokens // cfg.data.features.max_len)
    import pyarrow as pa

    table = pa.table({
        "row_id": pa.array([r["row_id"] for r in rows], type=pa.int64()),
        "input_ids": pa.array([r["input_ids"] for r in rows], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([r["loss_mask"] for r in rows], type=pa.list_(pa.int8())),
    })
    ds = ray.data.from_arrow(table).repartition(max(1, len(rows) // batch_rows))
    ds = ds.map_batches(
        FeatureActor,
        fn_constructor_kwargs={"target_cfg": cfg.target.model_dump(), "label": f"{label}: features",
                               "total_rows": len(rows), "kind": kind},
        batch_size=batch_rows,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=_num_actors(cfg)),
        **_actor_options(),
    )
    ds.write_parquet(str(out_dir), min_rows_per_file=cfg.data.features.rows_per_shard)


def prepare_dataset(cfg: ExperimentConfig, name: str, target) -> PrepareResult:
    """Compute (or reuse) the feature set of dataset ``name``; returns what was done. One process at a
    time prepares a feature set (a lock file ``.<folder>.lock`` beside it names the holder)."""
    fingerprint = target.fingerprint.to_dict()
    final = feature_set_path(cfg, name, fingerprint)
    final.parent.mkdir(parents=True, exist_ok=True)
    with folder_lock(final.parent, f"taps prepare ({name})", name=f".{final.name}.lock"):
        return _prepare_dataset(cfg, name, target, final, fingerprint)


def _prepare_dataset(cfg: ExperimentConfig, name: str, target, final: Path, fingerprint: dict) -> PrepareResult:
    from taps_ray.data.sources import load_dataset_alternatives

    if (final / MANIFEST).exists():
        fs = open_feature_set(final, fingerprint, name)
        m = fs.manifest
        if fs.prompt_hashes() is None:
            _backfill_prompts(cfg, name, final)
        return PrepareResult(name, str(final), True, m["origin"], m["rows"], m["tokens"], m["loss_tokens"],
                             m["megabytes"], m["seconds"], m.get("skipped", {}), m.get("regenerated", 0),
                             m.get("truncated", 0))
    start = time.perf_counter()
    source = load_dataset_alternatives(cfg.data.datasets[name])
    conversations = source.conversations
    regenerated = 0
    max_len = cfg.data.features.max_len
    skipped = dict(getattr(source, "skipped", {}) or {})
    if source.prompt_only and conversations:
        conversations, skipped["prompt_fills_max_len"] = drop_prompts_without_room(target.tokenizer, conversations,
                                                                                    max_len)
        log.info("%s: generating %d responses with the target (self-distillation); %d prompts of max_len=%d tokens "
                 "or more left out", name, len(conversations), skipped["prompt_fills_max_len"], max_len)
        conversations = _regenerate(cfg, conversations, target, name)
        regenerated = len(conversations)
    rows, hashes, truncated, no_loss = [], [], 0, 0
    for conv in conversations:
        tc = tokenize_conversation(target.tokenizer, conv, max_len)
        truncated += tc.truncated
        if sum(tc.loss_mask) == 0:
            no_loss += 1
            continue
        rows.append({"row_id": len(rows), "input_ids": tc.input_ids, "loss_mask": tc.loss_mask})
        hashes.append(conversation_hash(conv))
    skipped["no_assistant_tokens_after_truncation"] = no_loss
    if not rows:
        raise FeatureCacheError(f"dataset {name!r} ({source.origin}) produced no rows with assistant tokens")
    if truncated:
        log.info("%s: %d of %d conversations truncated to max_len=%d", name, truncated, len(conversations), max_len)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _write_features(cfg, rows, partial, name, feature_kind(cfg, name))
    seconds = time.perf_counter() - start
    tokens = int(sum(len(r["input_ids"]) for r in rows))
    manifest = {
        "dataset": name, "origin": source.origin, "rows": len(rows), "tokens": tokens,
        "loss_tokens": int(sum(sum(r["loss_mask"]) for r in rows)),
        "megabytes": round(sum(p.stat().st_size for p in partial.glob("*.parquet")) / 2**20, 2),
        "seconds": round(seconds, 2), "skipped": skipped, "truncated": truncated, "regenerated": regenerated,
        "max_len": max_len, "target": fingerprint, "format": FORMAT_VERSION,
        "layers": list(stored_layers(feature_kind(cfg, name), target.final_layer)),
        "computed_by": {k: target.describe().get(k) for k in ("device", "dtype", "engine", "weights")},
        "config": cfg.data.datasets[name].model_dump(),
    }
    write_feature_prompts(partial, hashes)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    write_json(final / MANIFEST, manifest)
    return PrepareResult(name, str(final), False, source.origin, len(rows), tokens, manifest["loss_tokens"],
                         manifest["megabytes"], round(seconds, 2), skipped, regenerated, truncated)


def _backfill_prompts(cfg: ExperimentConfig, name: str, path: Path) -> None:
    """Record the prompts of a feature set prepared before ``prompts.json`` existed: the hashes of every
    conversation its source gives now (a superset of its rows)."""
    from taps_ray.data.sources import SourceError, SourceUnavailable, load_dataset_alternatives

    try:
        source = load_dataset_alternatives(cfg.data.datasets[name])
    except (SourceError, SourceUnavailable) as err:
        log.warning("%s: features at %s have no %s and the source cannot be read again (%s); drafters trained "
                    "on them record no prompts for it", name, path, FEATURE_PROMPTS, err)
        return
    write_feature_prompts(path, [conversation_hash(c) for c in source.conversations], superset=True)
    log.info("%s: recorded the prompts of %d source conversations in %s", name, len(source.conversations),
             path / FEATURE_PROMPTS)


def prepare_features(cfg: ExperimentConfig, names: list[str] | None = None, target=None) -> list[PrepareResult]:
    """Prepare every dataset of ``cfg`` (or ``names``); Ray is started only when work is needed."""
    from taps_ray.models.target import TargetModel

    names = names or list(cfg.data.datasets)
    unknown = [n for n in names if n not in cfg.data.datasets]
    if unknown:
        raise ValueError(f"unknown dataset(s) {unknown}; datasets in config: {sorted(cfg.data.datasets)}")
    target = target or TargetModel.load(cfg.target)
    fingerprint = target.fingerprint.to_dict()
    if any(not (feature_set_path(cfg, n, fingerprint) / MANIFEST).exists() for n in names):
        from taps_ray.runtime.cluster import init_ray

        init_ray()
    return [prepare_dataset(cfg, n, target) for n in names]


def summary_table(results: list[PrepareResult]) -> str:
    header = ("| dataset | cache | origin | rows | tokens | loss tokens | truncated | skipped | MB | s | tokens/s |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [header]
    for r in results:
        lines.append(
            f"| {r.dataset} | {'hit' if r.cache_hit else 'computed'} | {r.origin} | {r.rows} | {r.tokens} | "
            f"{r.loss_tokens} | {r.truncated} | {sum(r.skipped.values())} | {r.megabytes} | "
            f"{r.seconds if not r.cache_hit else 0} | {r.tokens_per_s:.0f} |"
        )
    return "\n".join(lines)
