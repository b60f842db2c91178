"""Strategy names (torch-free, so an HTTP front end can validate them without loading torch).

See :mod:`taps_ray.spec.compose` for what each strategy does.
"""

from __future__ import annotations

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
