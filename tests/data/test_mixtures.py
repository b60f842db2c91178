import numpy as np
import pytest

from taps_ray.config import MixtureConfig
from taps_ray.data.mixtures import MixtureError, select_mixture, split_rows


def test_split_is_disjoint_and_seeded():
    held, pool = split_rows(100, 10, seed=3)
    assert held.size == 10 and pool.size == 90
    assert not set(held) & set(pool) and set(held) | set(pool) == set(range(100))
    assert np.array_equal(held, split_rows(100, 10, seed=3)[0])
    with pytest.raises(MixtureError, match="no training rows"):
        split_rows(5, 5)


def test_mixture_by_ratio_and_counts():
    pools = {"math": np.arange(0, 50), "chat": np.arange(100, 180)}
    by_ratio = select_mixture("mixed", MixtureConfig(ratio={"math": 0.25, "chat": 0.75}, total=40), pools)
    assert by_ratio.counts == {"chat": 30, "math": 10}
    assert set(by_ratio.rows["math"]) <= set(pools["math"])
    by_counts = select_mixture("c", MixtureConfig(counts={"math": 20, "chat": 20}, seed=1), pools)
    assert by_counts.counts == {"chat": 20, "math": 20} and by_counts.total == 40
    again = select_mixture("c", MixtureConfig(counts={"math": 20, "chat": 20}, seed=1), pools)
    assert all(np.array_equal(by_counts.rows[k], again.rows[k]) for k in pools)
    largest = select_mixture("max", MixtureConfig(ratio={"math": 0.5, "chat": 0.5}), pools)
    assert largest.counts == {"math": 50, "chat": 50}
    only_math = select_mixture("m", MixtureConfig(ratio={"math": 1.0, "chat": 0.0}, total=7), pools)
    assert only_math.counts == {"math": 7}


def test_mixture_asking_too_much_names_available_count():
    pools = {"math": np.arange(10)}
    with pytest.raises(MixtureError, match="only 10 training rows"):
        select_mixture("m", MixtureConfig(counts={"math": 11}), pools)
    with pytest.raises(MixtureError, match="unknown dataset"):
        select_mixture("m", MixtureConfig(counts={"chat": 1}), pools)
