"""Mixtures: seeded row selections over cached feature sets (features are never recomputed).

Each feature set's rows are split once, by a seeded permutation, into a held-out part (the
first ``heldout`` rows of the permutation) and a training pool (the rest). A mixture takes
rows from the pools by ``ratio`` of a ``total`` or by absolute ``counts``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from taps_ray.config import MixtureConfig


class MixtureError(ValueError):
    """A mixture asks for rows that do not exist or names an unknown dataset."""


def split_rows(num_rows: int, heldout: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(held-out row ids, training-pool row ids) of a feature set with ``num_rows`` rows."""
    if heldout >= num_rows:
        raise MixtureError(f"held-out size {heldout} leaves no training rows out of {num_rows}")
    order = np.random.default_rng(seed).permutation(num_rows)
    return np.sort(order[:heldout]), order[heldout:]


@dataclass
class MixtureSelection:
    """Training row ids per dataset; ``counts`` is how many rows each dataset contributes."""

    name: str
    rows: dict[str, np.ndarray]

    @property
    def counts(self) -> dict[str, int]:
        return {k: int(v.size) for k, v in self.rows.items()}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        return " + ".join(f"{n}:{c}" for n, c in self.counts.items())


def mixture_counts(mix: MixtureConfig, available: dict[str, int]) -> dict[str, int]:
    """Rows per dataset that ``mix`` asks for, checked against ``available`` pool sizes."""
    if mix.counts is not None:
        wanted = dict(mix.counts)
    else:
        ratio = mix.ratio or {}
        unknown = sorted(set(ratio) - set(available))
        if unknown:
            raise MixtureError(f"mixture names unknown dataset(s) {unknown}; available: {sorted(available)}")
        if mix.total is None:
            limits = [available[n] / r for n, r in ratio.items() if r > 0]
            total = int(min(limits))
        else:
            total = mix.total
        names = [n for n in ratio if ratio[n] > 0]
        wanted = {n: int(round(ratio[n] * total)) for n in names}
        if names:
            wanted[names[-1]] = total - sum(wanted[n] for n in names[:-1])
    for dataset, count in wanted.items():
        if dataset not in available:
            raise MixtureError(f"mixture names unknown dataset {dataset!r}; available: {sorted(available)}")
        if count > available[dataset]:
            raise MixtureError(
                f"mixture asks for {count} rows of {dataset!r} but only {available[dataset]} training rows "
                f"exist (after the held-out split); lower the count or prepare more data"
            )
    return {n: c for n, c in wanted.items() if c > 0}


def select_mixture(name: str, mix: MixtureConfig, pools: dict[str, np.ndarray]) -> MixtureSelection:
    """Take each dataset's count from the front of a seeded shuffle of its training pool."""
    counts = mixture_counts(mix, {k: int(v.size) for k, v in pools.items()})
    rows = {}
    for offset, (dataset, count) in enumerate(sorted(counts.items())):
        shuffled = np.random.default_rng(mix.seed + 1000 * offset).permutation(pools[dataset])
        rows[dataset] = np.sort(shuffled[:count])
    if not rows:
        raise MixtureError(f"mixture {name!r} selects no rows")
    return MixtureSelection(name=name, rows=rows)
