"""Fault injection for drills and tests: the one place training, sweeps and serving learn to fail.

* Training: ``fail_at_step`` in the worker config or ``$TAPS_TRAIN_FAIL_AT_STEP`` = ``N`` (every
  variant) or ``variant:N[,variant:N]``: :func:`fail_at_step` parses it and :func:`train_step_fault`
  raises :class:`InjectedFailure` before step ``N``, once per marker file (the loop keeps one per rank).
  ``$TAPS_TRAIN_STEP_DELAY_S`` (seconds, read by the workers) slows every step by that much
  (:func:`train_step_delay`), so a drill can act between two checkpoints (a node removed mid-run).
* Sweeps: ``$TAPS_SWEEP_FAIL`` = ``KEY=VALUE[,KEY=VALUE]`` (read by the driver): :func:`trial_fault`
  makes every attempt of the trials whose config matches all pairs raise :class:`InjectedTrialFailure`
  before any work.
* Serving: a drafter's ``fault: raise`` (its ``user_config``): :func:`drafter_fault` raises
  :class:`DrafterFault` on every draft call.

Each raises a subclass of :class:`InjectedFailure`, so a test can tell an injected failure from a real one.
Crash drills (``kill -9`` at random points) need no hook: the tests kill the process from outside.
"""

from __future__ import annotations

import math
from pathlib import Path

TRAIN_ENV = "TAPS_TRAIN_FAIL_AT_STEP"
TRAIN_DELAY_ENV = "TAPS_TRAIN_STEP_DELAY_S"
SWEEP_ENV = "TAPS_SWEEP_FAIL"


class InjectedFailure(RuntimeError):
    """A failure raised on purpose by this module."""


class InjectedTrialFailure(InjectedFailure):
    """A sweep trial's injected failure (:func:`trial_fault`)."""


class DrafterFault(InjectedFailure):
    """Raised by a served drafter configured with ``fault: raise``."""


def fail_at_step(value: str | int | None, variant: str) -> int | None:
    """Step at which ``variant`` fails: ``N`` (all variants) or ``name:N[,name:N]``; None = never."""
    if value is None or value == "":
        return None
    if isinstance(value, int):
        return value
    for item in str(value).split(","):
        name, _, step = item.strip().rpartition(":")
        if not name or name == variant:
            return int(step)
    return None


def train_step_fault(fail_at: int | None, next_step: int, marker: Path, variant: str) -> None:
    """Raise :class:`InjectedFailure` before ``next_step`` when it is ``fail_at`` and ``marker`` does not
    exist yet (it is created first, so the resumed attempt passes)."""
    if fail_at != next_step or marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    raise InjectedFailure(f"{variant}: injected failure before step {next_step} ({TRAIN_ENV})")


def train_step_delay() -> None:
    """Sleep ``$TAPS_TRAIN_STEP_DELAY_S`` seconds (unset or empty: none) before a training step."""
    import os
    import time

    value = os.environ.get(TRAIN_DELAY_ENV, "")
    if value:
        try:
            delay = float(value)
        except ValueError:
            raise ValueError(f"{TRAIN_DELAY_ENV}={value!r}: expected a number of seconds, e.g. 0.5") from None
        time.sleep(max(delay, 0.0))


def _matches(value, wanted: str) -> bool:
    try:
        return math.isclose(float(value), float(wanted))
    except (TypeError, ValueError):
        return str(value) == wanted


def trial_fault(fail: str | None, config: dict) -> None:
    """Raise :class:`InjectedTrialFailure` when ``fail`` (``KEY=VALUE[,..]``) matches ``config``."""
    if not fail:
        return
    pairs = [item.split("=", 1) for item in fail.split(",") if "=" in item]
    if pairs and all(key in config and _matches(config[key], value) for key, value in pairs):
        raise InjectedTrialFailure(f"injected failure for trial {config} ({SWEEP_ENV}={fail})")


def drafter_fault(fault: str | None, name: str) -> None:
    """Raise :class:`DrafterFault` when a served drafter's ``fault`` is ``raise``."""
    if fault == "raise":
        raise DrafterFault(f"drafter {name}: injected fault")
