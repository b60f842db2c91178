"""What ``taps eval`` runs, resolved from the config: :class:`EvalPlan`.

Strategy names are those of :mod:`taps_ray.spec.compose`; ``single`` runs once per drafter
(``single:NAME``), ``averaged`` of two drafters is ``averaged:0.5``, and ``eval.alphas`` add
``averaged:ALPHA`` runs. A drafter is a checkpoint folder (or ``release:NAME``) or ``random:SEED``, a
fresh untrained one; its identity (path and weights digest, or the seed) is part of the plan's
:meth:`~EvalPlan.identity`, as is a digest of the training prompts the drafters record.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from taps_ray.config import EvalConfig, ExperimentConfig, TreeConfig
from taps_ray.data.benchmarks import BENCHMARKS
from taps_ray.data.contamination import ContaminationError, read_trained_prompts
from taps_ray.drafter_sources import (
    RANDOM_DRAFTER,
    ReleaseDrafterError,
    random_drafter_seed,
    resolve_drafter_dir,
)
from taps_ray.models.drafter import WEIGHTS_NAME
from taps_ray.spec.strategy import StrategyError, parse_strategy

log = logging.getLogger(__name__)

DEFAULT_DRAFTERS = {"fresh0": "random:0", "fresh1": "random:1"}


class EvalError(ValueError):
    """The evaluation cannot run as asked; the message says why."""


@dataclass
class EvalPlan:
    """Everything a worker needs, resolved from the config (plain data, sent to Ray actors).

    ``strategies`` are concrete names in run order (vanilla first), decoded with ``tree`` (``method``:
    ``paper``, the paper's fixed tree without lookup, or ``production``, the configured one); with
    ``production_tree`` every drafting strategy is also decoded with it (records of method
    ``production``, for the speed table); ``drafters`` name -> folder or ``random:SEED``; ``compose`` the drafters that composed strategies combine, in order;
    ``excluded_prompts`` a digest of the training prompts those drafters record (None: none recorded).
    """

    target: dict
    tree: dict
    benchmarks: list[str]
    strategies: list[str]
    temperatures: list[float]
    limit: int | None
    max_new_tokens: int
    drafters: dict[str, str]
    compose: list[str]
    top_p: float = 1.0
    top_k: int = 0
    probe_steps: int = 2
    recheck_every: int = 0
    seed: int = 0
    num_actors: int = 1
    threads: int | None = None
    drafter_ids: dict[str, dict] = field(default_factory=dict)
    excluded_prompts: str | None = None
    method: str = "paper"
    production_tree: dict | None = None

    def identity(self) -> dict:
        """The settings existing records depend on: a resumed run must match them."""
        return {
            "target": {k: self.target.get(k) for k in ("model", "dtype", "max_context")},
            "tree": self.tree,
            **({"production_tree": self.production_tree} if self.production_tree else {}),
            "max_new_tokens": self.max_new_tokens,
            "sampling": {"top_p": self.top_p, "top_k": self.top_k, "seed": self.seed},
            "routing": {"probe_steps": self.probe_steps, "recheck_every": self.recheck_every},
            "drafters": self.drafter_ids,
            "compose": self.compose,
            **({"excluded_prompts": self.excluded_prompts} if self.excluded_prompts else {}),
        }

    def drafters_of(self, strategy: str) -> list[str]:
        return drafters_of(strategy, self.compose)


def drafters_of(strategy: str, compose: list[str]) -> list[str]:
    """Names of the drafters ``strategy`` uses, in order."""
    spec = parse_strategy(strategy)
    if spec.kind == "vanilla":
        return []
    if spec.kind == "single":
        return [spec.drafter]
    return list(compose)


def _drafter_identity(name: str, source: str) -> dict:
    try:
        seed = random_drafter_seed(source)
    except ValueError:
        raise EvalError(f"drafter {name!r}: {source!r} must be random:SEED with an integer seed") from None
    if seed is not None:
        return {"random_seed": seed}
    path = Path(source)
    if not (path / WEIGHTS_NAME).is_file():
        raise EvalError(f"drafter {name!r}: {str(path)!r} is not a drafter checkpoint folder (no {WEIGHTS_NAME}); "
                        "train it first (taps train) or pass random:SEED for an untrained drafter")
    digest = hashlib.sha256(path.joinpath(WEIGHTS_NAME).read_bytes()).hexdigest()[:16]
    return {"path": str(path.resolve()), "sha256": digest}


def trained_prompts_of(drafters: dict[str, str]) -> dict[str, set[str]]:
    """Prompt hashes each checkpoint drafter of ``drafters`` (name -> folder or ``random:SEED``) trained
    on; EvalError naming the drafter when its ``trained_prompts.json`` is malformed."""
    seen = {}
    for name, source in drafters.items():
        if source.startswith(RANDOM_DRAFTER):
            continue
        try:
            seen[name] = read_trained_prompts(source)
        except ContaminationError as err:
            raise EvalError(f"drafter {name!r}: {err}") from None
    return seen


def _digest(hashes: set[str]) -> str | None:
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()[:16] if hashes else None


def expand_strategies(names: Iterable[str], drafters: list[str], compose: list[str], alphas: Iterable[float] = ()) -> list[str]:
    """Concrete strategy names in run order: vanilla first, ``single`` once per drafter, ``averaged`` of
    two drafters as ``averaged:0.5``, one ``averaged:ALPHA`` per alpha; EvalError for unknown names or
    too few drafters."""
    out = ["vanilla"]
    for name in list(names) + [f"averaged:{a:g}" for a in alphas]:
        try:
            spec = parse_strategy(name)
        except ValueError as err:
            raise EvalError(str(err)) from None
        try:
            spec.bind(drafters if spec.kind == "single" else compose)
        except StrategyError as err:
            raise EvalError(f"{err} (eval.drafters / eval.compose)") from None
        if spec.kind == "single" and spec.drafter is None:
            concrete = [f"single:{n}" for n in drafters]
        elif spec.kind == "averaged" and spec.alpha is None and len(compose) == 2:
            concrete = ["averaged:0.5"]
        else:
            concrete = [spec.name]
        out += [c for c in concrete if c not in out]
    return out


def paper_tree(tree: TreeConfig) -> TreeConfig:
    """The paper's tree of ``tree``: the same EAGLE-2 dynamic tree, fixed in size, without prompt lookup."""
    return tree.model_copy(update={"adaptive": False, "lookup_tokens": 0})


def make_plan(cfg: ExperimentConfig) -> EvalPlan:
    """Resolve ``cfg.eval`` against the experiment: concrete strategies, drafter identities, checks."""
    ev: EvalConfig = cfg.eval
    unknown = [b for b in ev.benchmarks if b not in BENCHMARKS]
    if unknown:
        raise EvalError(f"unknown benchmark(s) {unknown}; valid: {', '.join(BENCHMARKS)}")
    drafters = dict(ev.drafters)
    if not drafters:
        log.warning("eval.drafters is empty: using two fresh untrained drafters %s", DEFAULT_DRAFTERS)
        drafters = dict(DEFAULT_DRAFTERS)
    try:
        drafters = {n: s if s.startswith(RANDOM_DRAFTER) else str(resolve_drafter_dir(s)) for n, s in drafters.items()}
    except ReleaseDrafterError as err:
        raise EvalError(str(err)) from None
    compose = list(ev.compose) if ev.compose else list(drafters)
    missing = [n for n in compose if n not in drafters]
    if missing:
        raise EvalError(f"eval.compose names unknown drafter(s) {missing}; drafters: {list(drafters)}")
    strategies = expand_strategies(ev.strategies, list(drafters), compose, ev.alphas)
    used = {n for s in strategies for n in drafters_of(s, compose)}
    ids = {name: _drafter_identity(name, src) for name, src in drafters.items() if name in used}
    seen = trained_prompts_of({n: drafters[n] for n in drafters if n in used})
    paper = paper_tree(cfg.tree).model_dump()
    return EvalPlan(
        target=cfg.target.model_dump(), tree=cfg.tree.model_dump() if ev.method == "production" else paper,
        method="production" if ev.method == "production" else "paper",
        production_tree=cfg.tree.model_dump() if ev.method == "both" else None, benchmarks=list(ev.benchmarks),
        strategies=strategies, temperatures=[float(t) for t in ev.temperatures], limit=ev.limit,
        max_new_tokens=ev.max_new_tokens, drafters={n: drafters[n] for n in drafters if n in used}, compose=compose,
        top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k, probe_steps=ev.probe_steps,
        recheck_every=ev.recheck_every, seed=ev.seed, num_actors=ev.num_actors, threads=ev.threads, drafter_ids=ids,
        excluded_prompts=_digest(set().union(*seen.values())),
    )
