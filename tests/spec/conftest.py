"""Fixtures of the speculative-decoding tests."""

from __future__ import annotations

import pytest

from tests.conftest import torch_threads
from tests.spec.spec_helpers import peaky_tiny_target


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: the models here are tiny or the machine is shared, and OpenMP spin-waits
    between two threads make every small matmul ~100x slower under CPU contention. Module scope, so it
    is in force before the module-scoped fixtures that decode."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def peaky_target():
    """Tiny random Llama (vocab 256, hidden 64) with peaked, context-dependent next-token distributions."""
    return peaky_tiny_target(0)
