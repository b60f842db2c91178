"""Batched verification: one target forward over the pending steps of several requests.

A request's step is a :class:`ForwardCall`: ``tokens`` [n] at ``positions`` [n] on top of the
request's own KV cache (length P), with an additive ``mask`` [n, P + n] (a draft tree, as
:func:`~taps_ray.spec.verify.tree_attention` builds it) or None (the n tokens causal among themselves:
a plain step). :func:`forward_batch` runs B calls as one forward: each layer's cache entries are
copied, right-padded, into a batch cache [B, kv_heads, P_max, d], the tokens into [B, n_max], and one
4D mask [B, 1, n_max, P_max + n_max] hides every row's padding. Each request's cache then gets its
own n new entries, and its output is its rows of the batch. One call is exactly
``TargetModel.forward``; every step after it (acceptance, compaction, sampling) stays per request.

:class:`ForwardBatcher` gathers the calls of decode loops running on several threads: the first
waiting thread leads, waits up to ``wait_s`` until ``expected()`` calls (at most ``max_batch``) are
pending, runs them with :func:`forward_batch` and hands each thread its output. :class:`BatchingTarget`
is a target whose ``forward`` goes through a batcher, so :func:`~taps_ray.spec.decoder.generate` runs
unchanged on it (prefill stays one request per forward: prompts differ too much in length to pad).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from taps_ray.models.target import TargetModel, TargetOutput
from taps_ray.spec.decoder import GenerationResult, generate


@dataclass
class ForwardCall:
    """One request's step: ``tokens`` [n] at ``positions`` [n] after ``cache`` (length P); ``mask``
    [n, P + n] additive in the target's dtype, or None for causal."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cache: DynamicCache
    mask: torch.Tensor | None = None


def _call_mask(call: ForwardCall, past: int, dtype: torch.dtype) -> torch.Tensor:
    """``call.mask``, or the causal mask [n, past + n] of a plain step."""
    if call.mask is not None:
        return call.mask
    n = call.tokens.numel()
    future = torch.ones(n, n, dtype=torch.bool, device=call.tokens.device).triu(1)
    causal = torch.zeros(n, past + n, dtype=dtype, device=call.tokens.device)
    causal[:, past:] = causal[:, past:].masked_fill(future, torch.finfo(dtype).min)
    return causal


def _padded_cache(calls: list[ForwardCall], lengths: list[int], width: int) -> DynamicCache:
    """A cache whose layer l holds every call's entries right-padded with zeros to ``width``: [B, h, width, d]."""
    batch = DynamicCache()
    for index, layers in enumerate(zip(*(call.cache.layers for call in calls), strict=True)):
        first = layers[0].keys
        shape = (len(calls), first.shape[1], width, first.shape[3])
        keys, values = first.new_zeros(shape), layers[0].values.new_zeros(shape)
        for row, (layer, length) in enumerate(zip(layers, lengths)):
            keys[row, :, :length] = layer.keys[0]
            values[row, :, :length] = layer.values[0]
        batch.update(keys, values, index)
    return batch


@torch.inference_mode()
def forward_batch(target: TargetModel, calls: list[ForwardCall]) -> list[TargetOutput]:
    """One target forward over ``calls``; output i is call i's (logits [1, n_i, V] float32, hidden
    [1, n_i, H]), and call i's cache is extended by its n_i entries, as ``target.forward`` would."""
    if len(calls) == 1:
        call = calls[0]
        mask = None if call.mask is None else call.mask[None, None]
        return [target.forward(call.tokens[None], call.positions[None], call.cache, mask)]
    device, dtype = target.device, target.dtype
    lengths = [call.cache.get_seq_length() for call in calls]
    sizes = [call.tokens.numel() for call in calls]
    if min(lengths) == 0:
        raise ValueError("forward_batch extends prefilled caches; a call has an empty cache (prefill it alone)")
    rows, width, span = len(calls), max(lengths), max(sizes)
    tokens = torch.zeros(rows, span, dtype=torch.long, device=device)
    positions = torch.zeros(rows, span, dtype=torch.long, device=device)
    mask = torch.full((rows, 1, span, width + span), torch.finfo(dtype).min, dtype=dtype, device=device)
    diagonal = torch.arange(span, device=device)
    mask[:, 0, diagonal, width + diagonal] = 0
    for row, (call, past, n) in enumerate(zip(calls, lengths, sizes)):
        tokens[row, :n] = call.tokens
        positions[row, :n] = call.positions
        own = _call_mask(call, past, dtype)
        mask[row, 0, :n, :past] = own[:, :past]
        mask[row, 0, :n, width:width + n] = own[:, past:]
    cache = _padded_cache(calls, lengths, width)
    hidden = target.forward_hidden(tokens, positions, cache, mask)
    valid = torch.cat([hidden[row, :n] for row, n in enumerate(sizes)])
    logits = target.logits(valid).split(sizes)
    outputs = []
    for row, (call, n) in enumerate(zip(calls, sizes)):
        for index, layer in enumerate(cache.layers):
            call.cache.update(layer.keys[row:row + 1, :, width:width + n], layer.values[row:row + 1, :, width:width + n],
                              index)
        outputs.append(TargetOutput(logits=logits[row][None], hidden=hidden[row:row + 1, :n], cache=call.cache))
    return outputs


class _Slot:
    __slots__ = ("call", "output", "error")

    def __init__(self, call: ForwardCall):
        self.call = call
        self.output: TargetOutput | None = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.output is not None or self.error is not None


class ForwardBatcher:
    """Gathers the target forwards of decode loops on several threads into :func:`forward_batch` calls.

    ``max_batch``: most calls per forward; ``wait_s``: how long the leading thread waits for more;
    ``expected``: how many calls are worth waiting for (e.g. the decode loops in flight; None:
    ``max_batch``), a batch runs as soon as that many are pending. ``sizes`` counts the batches run
    per size.
    """

    def __init__(self, target: TargetModel, max_batch: int = 8, wait_s: float = 0.002,
                 expected: Callable[[], int] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.target, self.max_batch, self.wait_s, self.expected = target, max_batch, wait_s, expected
        self.sizes: Counter = Counter()
        self._cond = threading.Condition()
        self._pending: list[_Slot] = []
        self._leading = False

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                attention_mask_4d: torch.Tensor | None = None) -> TargetOutput:
        """``TargetModel.forward`` for one request (``tokens`` [1, n]), run in a batch with others."""
        if tokens.shape[0] != 1:
            raise ValueError(f"ForwardBatcher.forward takes one request (tokens [1, n]), got {tuple(tokens.shape)}")
        mask = None if attention_mask_4d is None else attention_mask_4d[0, 0]
        slot = _Slot(ForwardCall(tokens[0], positions[0], cache, mask))
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
            outputs, error = forward_batch(self.target, [slot.call for slot in batch]), None
        except BaseException as err:
            outputs, error = None, err
        finally:
            self._cond.acquire()
        for i, slot in enumerate(batch):
            if error is None:
                slot.output = outputs[i]
            else:
                slot.error = error
        self.sizes[len(batch)] += 1
        self._leading = False
        self._cond.notify_all()


class BatchingTarget:
    """``target`` with its ``forward`` run through ``batcher``; every other attribute is the target's."""

    def __init__(self, target: TargetModel, batcher: ForwardBatcher):
        self._target, self._batcher = target, batcher

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                attention_mask_4d: torch.Tensor | None = None) -> TargetOutput:
        return self._batcher.forward(tokens, positions, cache, attention_mask_4d)

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
