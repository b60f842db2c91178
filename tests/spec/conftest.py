"""Fixtures of the speculative-decoding tests."""

from __future__ import annotations

import pytest

from tests.spec.spec_helpers import peaky_tiny_target


@pytest.fixture(scope="session")
def peaky_target():
    """Tiny random Llama (vocab 256, hidden 64) with peaked, context-dependent next-token distributions."""
    return peaky_tiny_target(0)
