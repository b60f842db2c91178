"""Batched verification: one target forward over the pending steps of several requests.

A request's step is a :class:`ForwardCall`: ``tokens`` [n] at ``positions`` [n] on top of the
request's own KV cache (length P), with an additive ``mask`` [n, P + n] (a draft tree, as
:func:`~taps_ray.spec.verify.tree_attention` builds it) or None (the n tokens causal among themselves:
a plain step). :func:`forward_batch` runs B calls as one forward: each layer's cache entries are
copied, right-padded, into a batch cache [B, kv_heads, P_max, d], the tokens into [B, n_max], and one
4D mask [B, 1, n_max, P_max + n_max] hides every row's padding. Each request's cache then gets its
own n new entries, and its output is its rows of the batch. One call is exactly
``TargetModel.forward``; every step after it (acceptance, compaction, sampling) stays per request.

:class:`Batcher` gathers calls made on several threads: the first waiting thread leads, waits up to
``wait_s`` until ``expected()`` calls (at most ``max_batch``) are pending, runs them as one batch and
hands each thread its output. :class:`ForwardBatcher` batches target forwards (:func:`forward_batch`);
:class:`BatchingTarget` is a target whose ``forward`` goes through one, so
:func:`~taps_ray.spec.decoder.generate` runs unchanged on it (prefills join the batch on the static
engine, whose packed forward needs no padding; on transformers' forward each prompt prefills alone:
prompts differ too much in length to pad). :class:`DraftBatcher` does the same for drafting: the
drafter forwards (:func:`draft_forward_batch`, same padding over the drafter's cache) and LM-head
products (:func:`head_batch`) of sessions drafting at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from taps_ray.models.drafter import DraftHead
from taps_ray.models.engine import KVCache, Segment
from taps_ray.models.target import TargetModel, TargetOutput, layer_columns, union_layers
from taps_ray.models.target_cache import TargetCache
from taps_ray.spec.batch_load import BatchLoad
from taps_ray.spec.decoder import GenerationResult, generate
from taps_ray.spec.draft_compute import DraftCompute, DraftHeadProduct, draft_log_probs


@dataclass
class ForwardCall:
    """One request's step: ``tokens`` [n] at ``positions`` [n] after ``cache`` (length P); ``mask``
    [n, P + n] additive in the target's dtype, or None for causal; ``layers``: the hidden states its drafters
    read (``TargetModel.forward``'s ``layers``)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cache: TargetCache
    mask: torch.Tensor | None = None
    layers: tuple[int, ...] | None = None


def _causal(n: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask [n, past + n] of n new tokens after a cache of ``past`` entries."""
    future = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    causal = torch.zeros(n, past + n, dtype=dtype, device=device)
    causal[:, past:] = causal[:, past:].masked_fill(future, torch.finfo(dtype).min)
    return causal


def _batch_mask(masks: list[torch.Tensor | None], lengths: list[int], sizes: list[int], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """One additive mask [B, 1, n_max, P_max + n_max] from each row's own [n_i, P_i + n_i] (None: causal):
    padded keys hidden, every padded query seeing only itself."""
    width, span = max(lengths), max(sizes)
    mask = torch.full((len(sizes), 1, span, width + span), torch.finfo(dtype).min, dtype=dtype, device=device)
    diagonal = torch.arange(span, device=device)
    mask[:, 0, diagonal, width + diagonal] = 0
    for row, (own, past, n) in enumerate(zip(masks, lengths, sizes)):
        own = _causal(n, past, dtype, device) if own is None else own
        mask[row, 0, :n, :past] = own[:, :past]
        mask[row, 0, :n, width:width + n] = own[:, past:]
    return mask


def _kv(cache: DynamicCache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index``'s (keys, values) [B, h, P, d] of a cache of full-history layers (``TargetModel.new_cache``)."""
    layer: Any = cache.layers[index]
    return layer.keys, layer.values


def _padded_cache(caches: list[DynamicCache], lengths: list[int]) -> DynamicCache:
    """A cache whose layer l holds every cache's entries right-padded with zeros to the longest: [B, h,
    P_max, d] (empty caches give zero rows; no layers when all are empty)."""
    batch, width = DynamicCache(), max(lengths)
    if width == 0:
        return batch
    for index in range(max(len(cache.layers) for cache in caches)):
        filled = [(row, *_kv(cache, index)) for row, (cache, n) in enumerate(zip(caches, lengths))
                  if n and index < len(cache.layers)]
        ref = filled[0][1]
        shape = (len(caches), ref.shape[1], width, ref.shape[3])
        keys, values = ref.new_zeros(shape), filled[0][2].new_zeros(shape)
        for row, row_keys, row_values in filled:
            keys[row, :, :lengths[row]] = row_keys[0]
            values[row, :, :lengths[row]] = row_values[0]
        batch.update(keys, values, index)
    return batch


def _extend(caches: list[DynamicCache], batch: DynamicCache, width: int, sizes: list[int]) -> None:
    """Append to each cache its row's n_i new entries of ``batch`` (those after ``width``)."""
    for row, (cache, n) in enumerate(zip(caches, sizes)):
        for index in range(len(batch.layers)):
            keys, values = _kv(batch, index)
            cache.update(keys[row:row + 1, :, width:width + n], values[row:row + 1, :, width:width + n], index)


def _rows(parts: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """``parts`` [n_i, ...] right-padded with zeros and stacked: [B, n_max, ...]."""
    out = parts[0].new_zeros((len(parts), max(sizes), *parts[0].shape[1:]))
    for row, (part, n) in enumerate(zip(parts, sizes)):
        out[row, :n] = part
    return out


@torch.inference_mode()
def forward_batch(target: TargetModel, calls: list[ForwardCall]) -> list[TargetOutput]:
    """One target forward over ``calls``; output i is call i's (logits [1, n_i, V] float32, hidden
    [1, n_i, H], features of its ``layers``), and call i's cache is extended by its n_i entries, as
    ``target.forward`` would. Calls asking for different layers share one forward of their union."""
    if len(calls) == 1:
        call = calls[0]
        mask = None if call.mask is None else call.mask[None, None]
        return [target.forward(call.tokens[None], call.positions[None], call.cache, mask, call.layers)]
    layers = union_layers([call.layers for call in calls])
    lengths = [call.cache.get_seq_length() for call in calls]
    sizes = [call.tokens.numel() for call in calls]
    static = [call.cache for call in calls if isinstance(call.cache, KVCache)]
    if len(static) == len(calls):
        return _forward_packed(target, calls, static, sizes, layers)
    if min(lengths) == 0:
        raise ValueError("forward_batch pads prefilled caches; a call has an empty cache (prefill it alone, or "
                         "run the static engine, whose packed forward prefills in the batch too)")
    caches = [call.cache for call in calls if isinstance(call.cache, DynamicCache)]
    if len(caches) < len(calls):
        raise ValueError(f"forward_batch got {len(static)} static-engine caches among {len(calls)} calls; batch "
                         "calls of one kind of cache (all KVCache or all DynamicCache)")
    mask = _batch_mask([call.mask for call in calls], lengths, sizes, target.dtype, target.device)
    cache = _padded_cache(caches, lengths)
    tokens, positions = _rows([c.tokens for c in calls], sizes), _rows([c.positions for c in calls], sizes)
    if layers is None:
        hidden, features = target.forward_hidden(tokens, positions, cache, mask), None
    else:
        hidden, features = target.forward_features(tokens, positions, cache, mask, layers)
    logits = target.logits(torch.cat([hidden[row, :n] for row, n in enumerate(sizes)])).split(sizes)
    _extend(caches, cache, max(lengths), sizes)
    return [TargetOutput(logits=logits[row][None], hidden=hidden[row:row + 1, :n], cache=call.cache,
                         features=_own(target, features, layers, call.layers, row, n))
            for row, (call, n) in enumerate(zip(calls, sizes))]


def _own(target: TargetModel, features: torch.Tensor | None, layers: tuple[int, ...] | None,
         want: tuple[int, ...] | None, row: int, n: int) -> torch.Tensor | None:
    """Row ``row``'s first n features [1, n, F] in the layout of its own ``want`` out of a batch's ``features``
    [B, n_max, F_union] of the union ``layers`` (None when the call asked for the last hidden state only)."""
    if features is None or layers is None or want is None or not target.feature_layers(want):
        return None
    part = features[row:row + 1, :n]
    return part if tuple(want) == layers else part[..., layer_columns(layers, tuple(want), target.hidden_size)]


def _forward_packed(target: TargetModel, calls: list[ForwardCall], caches: list[KVCache], sizes: list[int],
                    layers: tuple[int, ...] | None) -> list[TargetOutput]:
    """:func:`forward_batch` on the static engine (``caches``: the calls' own): the calls' tokens packed [T], each
    attending over its own cache (no padding, no cache copies)."""
    segments = [Segment(cache, n, call.mask) for call, cache, n in zip(calls, caches, sizes)]
    tokens, positions = torch.cat([c.tokens for c in calls]), torch.cat([c.positions for c in calls])
    if layers is None:
        hidden, features = target.forward_segments(tokens, positions, segments), None
    else:
        hidden, features = target.forward_segments(tokens, positions, segments, layers)
    logits = target.logits(hidden).split(sizes)
    parts = [None] * len(calls) if features is None else list(features.split(sizes))
    return [TargetOutput(logits=rows[None], hidden=part[None], cache=call.cache,
                         features=_own(target, None if f is None else f[None], layers, call.layers, 0, n))
            for call, rows, part, f, n in zip(calls, logits, hidden.split(sizes), parts, sizes)]


@dataclass
class DraftCall:
    """One session's drafter forward: ``embeds`` / ``features`` [n, H] at ``positions`` [n] after ``cache``
    (length P, possibly empty); ``mask`` [n, P + n] additive, or None for causal."""

    drafter: DraftHead
    embeds: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor
    cache: DynamicCache
    mask: torch.Tensor | None = None


@torch.inference_mode()
def draft_forward_batch(calls: list[DraftCall]) -> list[torch.Tensor]:
    """One drafter forward over ``calls`` (all of one drafter); output i is call i's [1, n_i, H], and
    call i's cache is extended by n_i entries, as ``drafter(...)`` would."""
    drafter = calls[0].drafter
    if any(call.drafter is not drafter for call in calls):
        raise ValueError("draft_forward_batch runs one drafter; group calls by drafter")
    if len(calls) == 1:
        call = calls[0]
        mask = None if call.mask is None else call.mask[None, None]
        return [drafter(call.embeds[None], call.features[None], call.positions[None], call.cache, mask)]
    lengths = [call.cache.get_seq_length() for call in calls]
    sizes = [call.positions.numel() for call in calls]
    dtype = calls[0].features.dtype
    mask = _batch_mask([call.mask for call in calls], lengths, sizes, dtype, calls[0].features.device)
    caches = [call.cache for call in calls]
    cache = _padded_cache(caches, lengths)
    hidden = drafter(_rows([c.embeds for c in calls], sizes), _rows([c.features for c in calls], sizes),
                     _rows([c.positions for c in calls], sizes), cache, mask)
    _extend(caches, cache, max(lengths), sizes)
    return [hidden[row:row + 1, :n] for row, n in enumerate(sizes)]


@torch.inference_mode()
def head_batch(calls: list[tuple[DraftHeadProduct, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    """:func:`~taps_ray.spec.draft_compute.draft_log_probs` of each ``(head, hidden [n_i, H])`` (``head`` a
    :class:`~taps_ray.spec.draft_compute.DraftHeadProduct`), one product per distinct head (rows of calls sharing a
    head stacked)."""
    out: list = [None] * len(calls)
    groups: dict[int, list[int]] = {}
    for i, (head, _) in enumerate(calls):
        groups.setdefault(id(head), []).append(i)
    for members in groups.values():
        head = calls[members[0]][0]
        sizes = [calls[i][1].shape[0] for i in members]
        parts = draft_log_probs(head, torch.cat([calls[i][1] for i in members]))
        for i, *split in zip(members, *(part.split(sizes) for part in parts)):
            out[i] = tuple(split)
    return out


class _Slot:
    __slots__ = ("call", "output", "error", "done")

    def __init__(self, call):
        self.call = call
        self.output = None
        self.error: BaseException | None = None
        self.done = False


class Batcher:
    """Gathers calls made on several threads into batches run by ``run`` (a list of calls -> their outputs).

    ``max_batch``: most calls per run; ``wait_s``: how long the leading thread waits for more;
    ``expected``: how many calls are worth waiting for (e.g. the loops in flight; None: ``max_batch``),
    a batch runs as soon as that many are pending. The first waiting thread leads: it gathers, runs the
    batch without the lock and hands every thread its output (or the batch's error). ``sizes`` counts
    the batches run per size.
    """

    def __init__(self, run: Callable[[list], list], max_batch: int = 8, wait_s: float = 0.002,
                 expected: Callable[[], int] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.run, self.max_batch, self.wait_s, self.expected = run, max_batch, wait_s, expected
        self.sizes: Counter = Counter()
        self._cond = threading.Condition()
        self._pending: list[_Slot] = []
        self._leading = False

    def submit(self, call):
        """``run([call, ...])``'s output for ``call``, run in a batch with other threads' calls."""
        slot = _Slot(call)
        with self._cond:
            self._pending.append(slot)
            self._cond.notify_all()
            while not slot.done:
                if self._leading:
                    self._cond.wait()
                else:
                    self._lead()
        if slot.error is not None:
            raise slot.error
        return slot.output

    def _wanted(self) -> int:
        expected = self.max_batch if self.expected is None else self.expected()
        return max(1, min(self.max_batch, expected))

    def _lead(self) -> None:
        """Under the lock: wait for a batch worth running, run it without the lock, hand out the outputs."""
        self._leading = True
        deadline = time.monotonic() + self.wait_s
        while len(self._pending) < self._wanted() and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
        self._cond.release()
        try:
            outputs, error = self.run([slot.call for slot in batch]), None
        except BaseException as err:
            outputs, error = None, err
        finally:
            self._cond.acquire()
        for i, slot in enumerate(batch):
            slot.output, slot.error, slot.done = (None if outputs is None else outputs[i]), error, True
        self.sizes[len(batch)] += 1
        self._leading = False
        self._cond.notify_all()


class ForwardBatcher(Batcher):
    """A :class:`Batcher` of target forwards (:func:`forward_batch`); ``load``: the
    :class:`~taps_ray.spec.batch_load.BatchLoad` of its requests, which holds each forward's rows and
    seconds."""

    def __init__(self, target: TargetModel, max_batch: int = 8, wait_s: float = 0.002,
                 expected: Callable[[], int] | None = None):
        super().__init__(self._forward, max_batch, wait_s, expected)
        self.target = target
        self.load = BatchLoad()

    def _forward(self, calls: list[ForwardCall]) -> list[TargetOutput]:
        start = time.perf_counter()
        out = forward_batch(self.target, calls)
        self.load.forward(sum(call.tokens.numel() for call in calls), time.perf_counter() - start)
        return out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                attention_mask_4d: torch.Tensor | None = None, layers: tuple[int, ...] | None = None) -> TargetOutput:
        """``TargetModel.forward`` for one request (``tokens`` [1, n]), run in a batch with others."""
        if tokens.shape[0] != 1:
            raise ValueError(f"ForwardBatcher.forward takes one request (tokens [1, n]), got {tuple(tokens.shape)}")
        mask = None if attention_mask_4d is None else attention_mask_4d[0, 0]
        return self.submit(ForwardCall(tokens[0], positions[0], cache, mask, layers))


class DraftBatcher(DraftCompute):
    """A :class:`~taps_ray.spec.draft_compute.DraftCompute` that runs the drafter forwards and LM-head
    products of sessions drafting at once (each on its own thread) in batches: sessions of one drafter
    advance through :func:`~taps_ray.spec.tree.draft_tree` in step, so each of its forwards and products is
    one batched call (:func:`draft_forward_batch`, :func:`head_batch`); trees equal those drafted one
    session at a time. ``expected``: the sessions drafting now."""

    def __init__(self, max_batch: int = 8, wait_s: float = 0.002, expected: Callable[[], int] | None = None):
        self.forwards = Batcher(self._forwards, max_batch, wait_s, expected)
        self.heads = Batcher(head_batch, max_batch, wait_s, expected)

    @staticmethod
    def _forwards(calls: list[DraftCall]) -> list[torch.Tensor]:
        out: list = [None] * len(calls)
        groups: dict[int, list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault(id(call.drafter), []).append(i)
        for members in groups.values():
            for i, hidden in zip(members, draft_forward_batch([calls[i] for i in members])):
                out[i] = hidden
        return out

    def forward(self, drafter: DraftHead, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: DynamicCache, mask: torch.Tensor | None) -> torch.Tensor:
        return self.forwards.submit(DraftCall(drafter, embeds[0], features[0], positions[0], cache,
                                              None if mask is None else mask[0, 0]))

    def log_probs(self, head: DraftHeadProduct,
                  hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.heads.submit((head, hidden))


class BatchingTarget:
    """``target`` with its ``forward`` run through ``batcher``; every other attribute is the target's.
    ``batch_load``: the last step of each request decoding on it, which a
    :class:`~taps_ray.spec.cost.TreeBudget` counts as the rest of its batch."""

    def __init__(self, target: TargetModel, batcher: ForwardBatcher):
        self._target, self._batcher = target, batcher
        self.batch_load = batcher.load

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                attention_mask_4d: torch.Tensor | None = None, layers: tuple[int, ...] | None = None) -> TargetOutput:
        return self._batcher.forward(tokens, positions, cache, attention_mask_4d, layers)

    def prefill(self, input_ids: torch.Tensor, cache: DynamicCache | None = None,
                layers: tuple[int, ...] | None = None) -> TargetOutput:
        """``TargetModel.prefill``, in the batch when the static engine packs it (one request, ``[1, T]``)."""
        if not isinstance(cache, KVCache):
            return self._target.prefill(input_ids, cache, layers)
        past = cache.get_seq_length()
        positions = torch.arange(past, past + input_ids.shape[1], device=self._target.device)[None]
        return self.forward(input_ids.to(self._target.device), positions, cache, layers=layers)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def generate_together(target: TargetModel, prompts: list, strategies: list | None = None,
                      samplings: list | None = None, max_batch: int = 8, wait_s: float = 0.002,
                      **kwargs) -> tuple[list[GenerationResult], ForwardBatcher]:
    """Decode every prompt at once, one thread per request, their steps verified in shared batches:
    the :func:`~taps_ray.spec.decoder.generate` results in prompt order and the batcher (its ``sizes``).
    ``strategies`` and ``samplings``: one per prompt (None: vanilla, greedy); ``kwargs`` go to every
    ``generate``."""
    strategies = strategies if strategies is not None else [None] * len(prompts)
    samplings = samplings if samplings is not None else [None] * len(prompts)
    if not len(strategies) == len(samplings) == len(prompts):
        raise ValueError(f"{len(strategies)} strategies and {len(samplings)} samplings for {len(prompts)} prompts")
    running = [len(prompts)]
    lock = threading.Lock()
    batcher = ForwardBatcher(target, max_batch, wait_s, expected=lambda: running[0])
    batched = BatchingTarget(target, batcher)

    def run(prompt, strategy, sampling):
        try:
            return generate(batched, prompt, strategy, sampling, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    with ThreadPoolExecutor(max(1, len(prompts)), thread_name_prefix="taps-batch") as pool:
        futures = [pool.submit(run, *request) for request in zip(prompts, strategies, samplings)]
        return [future.result() for future in futures], batcher
