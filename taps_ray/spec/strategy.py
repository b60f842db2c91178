"""Strategy names, and which drafters a strategy drafts with (torch-free, so an HTTP front end can validate
them without loading torch).

See :mod:`taps_ray.spec.compose` for what each strategy does. :meth:`StrategySpec.bind` is the one check of a
strategy against the drafters it may use, for every caller (in-process strategies, the evaluation plan, a
served request); each turns its :class:`StrategyError` into its own error at its boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SIGNALS = ("confidence", "entropy")
GRANULARITIES = ("step", "request")
MERGES = ("union", "budget")
DEFAULT_GRANULARITY = {"confidence": "step", "entropy": "request"}
STRATEGY_NAMES = (
    "vanilla",
    "single[:NAME]",
    "averaged[:ALPHA]",
    "routed:confidence[:step|:request]",
    "routed:entropy[:step|:request]",
    "merged:union",
    "merged:budget",
)
class StrategyError(ValueError):
    """A strategy that does not fit the drafters given to it; ``field``: what to change, ``strategy`` (it names
    a drafter that is not there) or ``drafters``."""

    def __init__(self, message: str, field: str = "drafters"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StrategySpec:
    """A parsed strategy name; :attr:`name` is its canonical spelling (granularity always explicit)."""

    kind: str
    signal: str | None = None
    granularity: str | None = None
    merge: str | None = None
    alpha: float | None = None
    drafter: str | None = None

    @property
    def name(self) -> str:
        if self.kind == "single":
            return "single" if self.drafter is None else f"single:{self.drafter}"
        if self.kind == "averaged":
            return "averaged" if self.alpha is None else f"averaged:{self.alpha:g}"
        if self.kind == "routed":
            return f"routed:{self.signal}:{self.granularity}"
        if self.kind == "merged":
            return f"merged:{self.merge}"
        return self.kind

    @property
    def min_drafters(self) -> int:
        return {"vanilla": 0, "single": 1}.get(self.kind, 2)

    def bind(self, drafters: Sequence[str]) -> tuple[str, ...]:
        """The drafters this strategy drafts with, out of ``drafters`` (distinct names, in routing / merge
        order): none for ``vanilla``; for ``single`` the one it names, else the first; all of them otherwise
        (``averaged:ALPHA`` interpolates exactly two; ``averaged`` averages them uniformly; ``routed`` and
        ``merged`` compose two or more). :class:`StrategyError` when they do not fit."""
        names = list(drafters)
        if self.kind == "vanilla":
            return ()
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise StrategyError(f"strategy {self.name!r} takes distinct drafters; {names} repeats {repeated}")
        if self.kind == "single":
            if self.drafter is not None and self.drafter not in names:
                raise StrategyError(f"strategy {self.name!r}: no drafter named {self.drafter!r}; drafters: {names}",
                                    field="strategy")
            if not names:
                raise StrategyError(f"strategy {self.name!r} needs a drafter, got 0")
            return (self.drafter or names[0],)
        need = self.min_drafters
        if len(names) < need:
            raise StrategyError(f"strategy {self.name!r} needs at least {need} drafters, got {len(names)}: it "
                                f"composes {need} or more distinct drafters ({names})")
        if self.kind == "averaged" and self.alpha is not None and len(names) != 2:
            raise StrategyError(f"strategy {self.name!r} interpolates two drafters, got {len(names)} ({names}); "
                                "use 'averaged' (uniform) or give two drafters")
        return tuple(names)


def _unknown(name: str, why: str = "") -> ValueError:
    return ValueError(f"unknown strategy {name!r}{why}; valid: {', '.join(STRATEGY_NAMES)}")


def parse_strategy(name: str | StrategySpec) -> StrategySpec:
    """The :class:`StrategySpec` of ``name`` (see :data:`STRATEGY_NAMES`); ValueError listing the valid
    names when it is not one of them, or when ALPHA is not a number in [0, 1]."""
    if isinstance(name, StrategySpec):
        return name
    if not isinstance(name, str):
        raise _unknown(repr(name))
    kind, *rest = name.strip().split(":")
    if kind == "vanilla" and not rest:
        return StrategySpec("vanilla")
    if kind == "single" and len(rest) <= 1:
        if rest and not rest[0]:
            raise _unknown(name, " (empty drafter name)")
        return StrategySpec("single", drafter=rest[0] if rest else None)
    if kind == "averaged" and len(rest) <= 1:
        if not rest:
            return StrategySpec("averaged")
        try:
            alpha = float(rest[0])
        except ValueError:
            raise _unknown(name, f" (ALPHA must be a number in [0, 1], got {rest[0]!r})") from None
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"strategy {name!r}: alpha must be in [0, 1], got {alpha}")
        return StrategySpec("averaged", alpha=alpha)
    if kind == "routed" and 1 <= len(rest) <= 2 and rest[0] in SIGNALS:
        granularity = rest[1] if len(rest) == 2 else DEFAULT_GRANULARITY[rest[0]]
        if granularity in GRANULARITIES:
            return StrategySpec("routed", signal=rest[0], granularity=granularity)
    if kind == "merged" and len(rest) == 1 and rest[0] in MERGES:
        return StrategySpec("merged", merge=rest[0])
    raise _unknown(name)
