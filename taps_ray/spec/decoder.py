"""The generate loop: plain (vanilla) decoding and speculative decoding through a
:class:`~taps_ray.spec.protocol.Strategy`.

Both paths share one ``TargetModel.forward`` and one KV cache per request, so their speeds are
comparable. Drafter alignment (EAGLE): the drafter consumes pairs ``(token_{i+1}, f_i)``, where
``f_i`` is the target's feature at position i; after a step that accepted nodes
``root, a_1 .. a_k`` and sampled the bonus ``b``, the new pairs are ``(a_1, f_root), ..,
(b, f_{a_k})``.

The loop of :func:`generate`: :func:`_setup`, :func:`_prefill`, then one :func:`_step` per target
verification (a :func:`_plain_step` or a :func:`_tree_step`, then :func:`_append`) until a finish
reason, then :func:`_result`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from taps_ray.config import SamplingConfig, TreeConfig
from taps_ray.drafter_sources import random_drafter_seed
from taps_ray.models.drafter import DraftHead
from taps_ray.models.target import TargetModel
from taps_ray.models.target_cache import TargetCache
from taps_ray.spec import stats
from taps_ray.spec.batch_load import BatchLoad, Others
from taps_ray.spec.cost import TreeBudget
from taps_ray.spec.logprobs import TokenLogprobs, check_top, token_logprobs
from taps_ray.spec.protocol import DecodeState, SingleStrategy, Strategy, VanillaStrategy
from taps_ray.spec.stats import StepRecord
from taps_ray.spec.stream import Cancel, StepObserver, TextStream, interrupted, observe, text_stream
from taps_ray.spec.tree import DraftTree, check_distinct_siblings, repeated_siblings
from taps_ray.spec.verify import (
    Verdict,
    compact_target,
    process_logits,
    run_tree,
    verify_greedy,
    verify_sampling,
)


@dataclass
class GenerationResult:
    """``token_ids`` generated (EOS kept when hit; up to the token that completed a stop sequence),
    ``finish_reason`` eos | length | context | stop | cancelled | timeout; ``text`` (with a tokenizer) ends
    before a stop sequence; ``logprobs`` (only when asked): each generated token's raw log-probability under the target and
    the top alternatives (:mod:`taps_ray.spec.logprobs`), on the CPU."""

    token_ids: list[int]
    text: str | None
    prompt_len: int
    finish_reason: str
    strategy: str
    prefill_s: float
    total_s: float
    steps: list[StepRecord] = field(default_factory=list)
    logprobs: TokenLogprobs | None = None

    @property
    def tau(self) -> float:
        return stats.tau(self.steps)

    @property
    def accept_lengths(self) -> list[int]:
        return [s.accepted for s in self.steps]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall second of the whole call (prefill included)."""
        return len(self.token_ids) / self.total_s if self.total_s > 0 else float("nan")

    def to_dict(self, with_steps: bool = False) -> dict:
        out: dict[str, Any] = {
            "text": self.text, "token_ids": self.token_ids, "strategy": self.strategy,
            "finish_reason": self.finish_reason, "prompt_len": self.prompt_len, "steps": len(self.steps),
            "tau": self.tau if self.steps else None, "accept_lengths": self.accept_lengths, "tokens_per_s": self.tokens_per_s,
            "prefill_s": self.prefill_s, "total_s": self.total_s,
        }
        if with_steps:
            out["step_records"] = [s.to_dict() for s in self.steps]
        return out


def load_drafter(target: TargetModel, directory: str | None = None, seed: int = 0) -> DraftHead:
    """The drafter checkpoint in ``directory`` for ``target`` (``DrafterLoadError`` if it does not
    fit), or a freshly initialised drafter from ``seed`` when ``directory`` is None."""
    if directory is None:
        return DraftHead(target.config, seed=seed).to(target.device, target.dtype).eval()
    return DraftHead.load(directory, target.config, target.fingerprint, target.device, target.dtype)


def load_drafter_source(target: TargetModel, name: str, source: str) -> DraftHead:
    """The drafter of ``source`` (a checkpoint folder, or ``random:SEED``) for ``target``, named ``name``
    in its metadata unless it has a name."""
    seed = random_drafter_seed(source)
    head = load_drafter(target, source if seed is None else None, seed or 0)
    head.metadata.setdefault("name", name)
    return head


def check_sampling(sampling: SamplingConfig | dict | None) -> SamplingConfig:
    """A validated :class:`SamplingConfig` (greedy when None); bad values raise ValueError naming them."""
    if sampling is None:
        return SamplingConfig()
    values = sampling.model_dump() if isinstance(sampling, SamplingConfig) else dict(sampling)
    temperature = values.get("temperature", 0.0)
    top_p = values.get("top_p", 1.0)
    top_k = values.get("top_k", 0)
    if not isinstance(temperature, int | float) or not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    return SamplingConfig(**values)


def prompt_ids(target: TargetModel, prompt) -> torch.Tensor:
    """Token ids [T] from ids (list / tensor), chat ``messages`` (list of dicts) or a user message string."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty")
        if target.tokenizer is None:
            raise ValueError("this target has no tokenizer: pass token ids instead of text")
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list | tuple) and prompt and isinstance(prompt[0], dict):
        ids = target.encode_chat(list(prompt))[0]
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("prompt is empty (0 tokens)")
    if ids.numel() >= target.max_context:
        raise ValueError(f"prompt has {ids.numel()} tokens; the target's max_context {target.max_context} "
                         f"leaves room for at most {target.max_context - 1}")
    return ids.to(target.device)


def _token_entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(-1)


@dataclass
class _Request:
    """One :func:`generate` call's state: the sampling rule, the token buffer (prompt then generated
    tokens, ``length`` of them filled), the KV cache and the steps so far."""

    target: TargetModel
    strategy: Strategy
    sampling: SamplingConfig
    max_new_tokens: int
    eos: torch.Tensor
    generator: torch.Generator | None
    collect_entropy: bool
    timer: Callable[[], float]
    top: int | None = None
    on_logprobs: Callable[[TokenLogprobs], None] | None = None
    feature_sink: list[torch.Tensor] | None = None
    budget: TreeBudget | None = None
    load: BatchLoad | None = None
    text: TextStream | None = None
    observer: StepObserver | None = None
    cancel: Cancel | None = None
    deadline: float | None = None
    node_limit: Callable[[], int] | None = None
    path: torch.Tensor | None = None
    drafted: bool = False
    prompt_len: int = 0
    length: int = 0
    tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    cache: TargetCache | None = None
    steps: list[StepRecord] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def kv(self) -> TargetCache:
        """The request's KV cache (set by its prefill)."""
        if self.cache is None:
            raise RuntimeError("the request has no KV cache before its prefill")
        return self.cache

    @property
    def greedy(self) -> bool:
        return self.sampling.temperature == 0

    @property
    def layers(self) -> tuple[int, ...] | None:
        """The target hidden states the strategy's drafters read (its ``feature_layers``; None: the last one)."""
        return getattr(self.strategy, "feature_layers", None)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token from ``logits``: argmax when greedy, else sampled with the request's generator."""
        if self.greedy:
            return logits.argmax(-1)
        probs = process_logits(logits, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def record_logprobs(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keep the logprobs of the committed ``tokens`` [n] from the target's ``rows`` [n, V] (the
        distributions they were drawn from) and hand them to ``on_logprobs``; nothing when not asked."""
        if self.top is None:
            return
        part = token_logprobs(rows, tokens, self.top)
        self.logprobs.append(part)
        if self.on_logprobs is not None:
            self.on_logprobs(part)


@torch.inference_mode()
def generate(
    target: TargetModel, prompt, strategy: Strategy | None = None, sampling: SamplingConfig | dict | None = None,
    max_new_tokens: int = 128, eos_token_ids: set[int] | frozenset[int] | None = None, collect_entropy: bool = True,
    timer: Callable[[], float] = time.perf_counter, logprobs: int | None = None,
    on_logprobs: Callable[[TokenLogprobs], None] | None = None, feature_sink: list[torch.Tensor] | None = None,
    budget: TreeBudget | None = None, stop: Sequence[str] | None = None, observer: StepObserver | None = None,
    cancel: Cancel | None = None, deadline: float | None = None, node_limit: Callable[[], int] | None = None,
) -> GenerationResult:
    """Decode up to ``max_new_tokens`` tokens after ``prompt`` (see :func:`prompt_ids`).

    ``strategy`` None or :class:`VanillaStrategy` decodes plainly; greedy when
    ``sampling.temperature == 0`` (speculative output then equals vanilla token for token), else
    lossless speculative sampling seeded by ``sampling.seed``. Stops after an EOS token (kept),
    at ``max_new_tokens`` (a longer accepted path is trimmed) or at the target's context limit.
    ``timer`` clocks the recorded times (``time.process_time`` gives CPU time, which other load
    on a shared machine barely inflates when torch runs one thread).

    ``logprobs`` (None: off, at no cost; else the number of alternatives, 0..20) returns each
    generated token's raw log-probability under the target with the top alternatives
    (``result.logprobs``), sliced from the logits the verification forward already computed (no
    extra forward pass); ``on_logprobs`` receives them as they are committed, the first token's
    before ``strategy.start`` and each step's before ``strategy.advance``.

    ``feature_sink`` (None: off) receives the target features the loop computed anyway, on the
    device, as they are committed: the prompt's [P, H] after prefill, then each step's [k, H] before
    ``strategy.advance`` (so it is complete even when the strategy stops the loop). Concatenated,
    row i is the target's last hidden state at position i of prompt + committed tokens, for every
    position but the last (whose feature no forward pass has computed yet).

    ``budget`` (None: the strategy's own ``tree_budget`` attribute, which :func:`~taps_ray.spec.compose.build_strategy`
    sets when ``tree.adaptive``; neither: every proposed tree is verified whole) picks each step's tree
    size from a measured cost model (:class:`~taps_ray.spec.cost.TreeBudget`): the best-scored nodes that
    maximise expected tokens per second, a plain step when none pays, and no drafting at all while
    drafting does not pay. On a target with a ``batch_load`` (:class:`~taps_ray.spec.batch.BatchingTarget`)
    it counts the other requests of the batch. It changes what is verified, never what is accepted.

    The loop owns every way a request ends early: ``stop`` (stop sequences; needs the target's tokenizer)
    ends it after the token that completes one (finish ``stop``; the text ends before it); ``cancel`` (a
    flag, checked before each step) ends it with ``cancelled``; ``deadline`` (``time.monotonic()``) with
    ``timeout``; ``observer`` (:class:`~taps_ray.spec.stream.StepObserver`) sees each step's tokens and text and may end it with a
    reason of its own. ``node_limit`` (None: none) gives, each step, the most nodes the tree to verify may
    have (a batch's load): a larger tree is cut to its best-scored nodes (:meth:`DraftTree.top`, counted in
    the step's ``shed``) and a limit of 1 decodes the step plainly without drafting (``load_plain``).
    """
    request, ids = _setup(target, prompt, strategy, sampling, max_new_tokens, eos_token_ids, collect_entropy, timer)
    request.top, request.on_logprobs, request.feature_sink = check_top(logprobs), on_logprobs, feature_sink
    request.observer, request.cancel, request.deadline, request.node_limit = observer, cancel, deadline, node_limit
    request.text = text_stream(target.tokenizer, stop, observer)
    budget = budget if budget is not None else getattr(request.strategy, "tree_budget", None)
    if budget is not None and not isinstance(request.strategy, VanillaStrategy):
        request.budget = budget.bind(target)
        request.load = getattr(target, "batch_load", None)
    return _decode(request, ids)


def greedy_steps(target: TargetModel, drafter: DraftHead, prompts, tree: TreeConfig,
                 max_new_tokens: int) -> list[list[StepRecord]]:
    """Each prompt's step records (``prompts``: token ids) under greedy speculative decoding with ``drafter``'s
    EAGLE-2 tree, fixed in size (no cost-model budget: a tau that does not follow the machine's timings)."""
    strategy = SingleStrategy(drafter, tree)
    return [generate(target, torch.as_tensor(ids, dtype=torch.long), strategy, None, max_new_tokens,
                     collect_entropy=False).steps for ids in prompts]


def _setup(target: TargetModel, prompt, strategy: Strategy | None, sampling: SamplingConfig | dict | None,
           max_new_tokens: int, eos_token_ids, collect_entropy: bool,
           timer: Callable[[], float]) -> tuple[_Request, torch.Tensor]:
    """The checked arguments as a :class:`_Request`, and the prompt's token ids."""
    strategy = strategy or VanillaStrategy()
    sampling = check_sampling(sampling)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    ids = prompt_ids(target, prompt)
    eos = torch.tensor(sorted(target.eos_token_ids if eos_token_ids is None else eos_token_ids),
                       dtype=torch.long, device=target.device)
    generator = None
    if sampling.temperature != 0 and sampling.seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(sampling.seed)
    return _Request(target, strategy, sampling, max_new_tokens, eos, generator, collect_entropy, timer), ids


def _decode(request: _Request, ids: torch.Tensor) -> GenerationResult:
    """Prefill ``ids`` [P] and step until a finish reason, timed by the request's timer; the request leaves its
    batch load however the loop ends."""
    start = request.timer()
    try:
        finish = _prefill(request, ids)
        prefill_s = request.timer() - start
        while finish is None:
            finish = _interrupted(request) or _step(request)
    finally:
        if request.load is not None:
            request.load.drop(id(request))
    total_s = request.timer() - start
    return _result(request, finish, prefill_s, total_s)


def _interrupted(request: _Request) -> str | None:
    """``cancelled`` or ``timeout`` when the request's flag is set or its deadline has passed."""
    return interrupted(request.cancel, request.deadline)


def _observe(request: _Request, start: int) -> str | None:
    """Hand the tokens committed at ``start .. length - 1`` to the request's text stream and observer; at a
    stop sequence, cut ``length`` after the token that completed it. The finish reason when the request ends."""
    if request.text is None and request.observer is None:
        return None
    kept, reason = observe(request.text, request.observer, request.tokens[start:request.length].tolist())
    request.length = start + len(kept)
    return reason


def _prefill(request: _Request, ids: torch.Tensor) -> str | None:
    """Prefill the prompt, choose the first token and start the strategy; the finish reason when that
    token already ends the request."""
    target, max_new_tokens = request.target, request.max_new_tokens
    prompt_len = request.prompt_len = ids.numel()
    request.cache = target.new_cache(prompt_len + max_new_tokens + 64)
    out = target.prefill(ids[None], request.cache, layers=request.layers)
    if request.feature_sink is not None:
        request.feature_sink.append(out.hidden[0])
    tokens = request.tokens = torch.empty(prompt_len + max_new_tokens, dtype=torch.long, device=target.device)
    tokens[:prompt_len] = ids
    tokens[prompt_len:prompt_len + 1] = request.choose(out.logits[0, -1:])
    request.length = prompt_len + 1
    request.record_logprobs(out.logits[0, -1:], tokens[prompt_len:prompt_len + 1])
    if (reason := _observe(request, prompt_len)) is not None:
        return reason
    if bool(torch.isin(tokens[prompt_len], request.eos)):
        return "eos"
    if max_new_tokens == 1:
        return "length"
    request.strategy.start(target, tokens[1:request.length], out.drafter_features[0])
    return None


def _step(request: _Request) -> str | None:
    """One target verification: the strategy proposes a tree (or none: a plain step), the target
    verifies it, the accepted tokens are appended; the finish reason when the request ends."""
    r = request.length - 1
    if r >= request.target.max_context:
        return "context"
    t0, wall = request.timer(), time.perf_counter()
    budget, tree = request.budget, None
    group = None if budget is None else id(budget)
    others = request.load.others(id(request), group) if request.load is not None else Others()
    limit = None if request.node_limit is None else max(1, request.node_limit())
    state = DecodeState(request.tokens[:request.length], r, request.prompt_len, len(request.steps))
    limited = {"shed": 0, "load_plain": limit == 1}
    first_draft = False
    if limit != 1 and (budget is None or budget.should_draft(others)):
        first_draft, request.drafted = not request.drafted, True
        state.depth = None if budget is None else budget.depth(others)
        tree = request.strategy.propose(state)
        if tree is not None and limit is not None and tree.size > limit:
            limited["shed"], tree = tree.size - limit, tree.top(limit)
        if budget is not None and tree is not None:
            tree = budget.choose(tree, time.perf_counter() - wall, others)
    t1, verify_wall = request.timer(), time.perf_counter()
    draft_s = verify_wall - wall
    if tree is None:
        new, hidden, features, rows, record = _plain_step(request, r)
    else:
        new, hidden, features, rows, record = _tree_step(request, tree, r)
    record.update(limited)
    if state.notes:
        record["meta"] = {**record.get("meta", {}), **state.notes}
    if budget is not None:
        done = time.perf_counter()
        verify_s, other_rows = done - verify_wall, others[0]
        if request.load is not None and request.load.last_forward is not None:
            total, verify_s = request.load.last_forward
            other_rows = total - (1 if tree is None else tree.size)
        budget.observe(tree, request.path, None if first_draft else draft_s, verify_s, max(other_rows, 0))
        if request.load is not None:
            request.load.note(id(request), 1 if tree is None else tree.size, int(new.numel()), draft_s, group)
    return _append(request, new, hidden, features, rows, record, t0, t1)


def _plain_step(request: _Request, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                     dict]:
    """One target forward on the last token: (the next token, its last hidden state, its drafter features, the
    target's logits it was drawn from, the step's record fields)."""
    target = request.target
    positions = torch.full((1, 1), r, dtype=torch.long, device=target.device)
    out = target.forward(request.tokens[r:request.length][None], positions, request.kv, layers=request.layers)
    new = request.choose(out.logits[0])
    return new, out.hidden[0], out.drafter_features[0], out.logits[0], {"accepted": 0, "tree_size": 1,
                                                                       "tree_depth": 0, "rejected": False}


def _tree_step(request: _Request, tree: DraftTree,
               r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:
    """Verify ``tree`` (cut to the context left) and compact the KV cache to the accepted path:
    (the accepted tokens and the bonus, their last hidden states and drafter features, the target's logits
    [k + 1, V] at the path's
    nodes, which they were drawn from (None unless logprobs are asked), the step's record fields)."""
    target, strategy, sampling = request.target, request.strategy, request.sampling
    if tree.prefix_len != r:
        raise RuntimeError(f"strategy {strategy.name!r} drafted from prefix length {tree.prefix_len}, "
                           f"the target is at {r}")
    proposed, repeated = tree, repeated_siblings(tree.tokens, tree.parent)  # read at the walk's sync
    if tree.size > target.max_context - r:
        tree = tree.select(torch.arange(target.max_context - r, device=tree.tokens.device))
    out = run_tree(target, tree, request.kv, request.layers)
    logits = out.logits[0]
    if request.greedy:
        verdict = verify_greedy(tree, logits)
    else:
        verdict = verify_sampling(tree, logits, sampling.temperature, sampling.top_p, sampling.top_k,
                                  request.generator)
    if bool(repeated):
        try:
            check_distinct_siblings(proposed.tokens, proposed.parent)
        except ValueError as err:
            raise RuntimeError(f"strategy {strategy.name!r} proposed an invalid tree: {err}") from None
    compact_target(request.kv, tree, verdict)
    record = {"accepted": verdict.accepted, "tree_size": tree.size, "tree_depth": tree.depth.max(),
              "rejected": verdict.rejected >= 0}
    if request.collect_entropy:
        record.update(_entropies(tree, logits, verdict))
    if tree.meta:
        record["meta"] = tree.meta
    rows = logits[verdict.path] if request.top is not None else None
    request.path = verdict.path
    return verdict.tokens, out.hidden[0, verdict.path], out.drafter_features[0, verdict.path], rows, record


def _append(request: _Request, new: torch.Tensor, hidden: torch.Tensor, features: torch.Tensor,
            rows: torch.Tensor | None, record: dict, t0: float, t1: float) -> str | None:
    """Append ``new`` up to its first EOS and the token budget (and the logprobs of those from
    ``rows``), hand them to the observer (:func:`_observe`, which cuts them at a stop sequence), record the
    step, and advance the strategy; the finish reason when the request ends here."""
    is_eos = torch.isin(new, request.eos)
    first_eos = int(torch.where(is_eos.any(), is_eos.int().argmax(), new.numel()))
    start = request.length
    keep = min(new.numel(), request.max_new_tokens - (start - request.prompt_len), first_eos + 1)
    request.tokens[start:start + keep] = new[:keep]
    request.length += keep
    if rows is not None:
        request.record_logprobs(rows[:keep], new[:keep])
    reason = _observe(request, start)
    keep = request.length - start
    if request.feature_sink is not None:
        request.feature_sink.append(hidden[:keep])
    request.steps.append(StepRecord(appended=keep, draft_s=t1 - t0, verify_s=request.timer() - t1, **record))
    if reason is not None:
        return reason
    if first_eos < new.numel() and keep == first_eos + 1:
        return "eos"
    if request.length - request.prompt_len >= request.max_new_tokens:
        return "length"
    request.strategy.advance(new, features)
    return None


def _result(request: _Request, finish: str, prefill_s: float, total_s: float) -> GenerationResult:
    target, prompt_len = request.target, request.prompt_len
    generated = request.tokens[prompt_len:request.length].tolist()
    text: str | None
    if request.text is not None:
        text = request.text.text
    else:
        text = target.tokenizer.decode(generated, skip_special_tokens=True) if target.tokenizer is not None else None
    logprobs = None
    if request.top is not None:
        logprobs = TokenLogprobs.cat(request.logprobs, request.top)[:len(generated)].cpu()
    return GenerationResult(token_ids=generated, text=text, prompt_len=prompt_len, finish_reason=finish,
                            strategy=request.strategy.name, prefill_s=prefill_s, total_s=total_s,
                            steps=request.steps, logprobs=logprobs)


def _entropies(tree: DraftTree, logits: torch.Tensor, verdict: Verdict) -> dict:
    """Draft / target entropies of the accepted tokens and of the rejected one (NaN when none)."""
    target_entropy = _token_entropy(logits[verdict.path])
    rejected = verdict.rejected
    has_rejected = rejected >= 0
    nan = torch.full((), float("nan"))
    return {
        "draft_entropy": tree.entropy[verdict.path[1:]],
        "target_entropy": target_entropy[:-1],
        "rejected_draft_entropy": torch.where(has_rejected, tree.entropy[rejected.clamp(min=0)], nan),
        "rejected_target_entropy": torch.where(has_rejected, target_entropy[-1], nan),
    }
