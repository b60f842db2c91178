"""Helpers shared by the data tests (and the tests that read benchmarks)."""

from __future__ import annotations

from taps_ray.data import origins


def cut_off_hub(monkeypatch) -> None:
    """Point the HF hub at a port that refuses connections at once, with no offline cache and no
    remembered probe, so every hub source is unavailable quickly."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(origins, "_hub_probes", {})
