"""The ``taps adapt --watch`` loop around its training and its swap (both faked here; the end-to-end loop is in
``test_adapt.py``): what it prunes after a round, how it shares the run folder with other commands, and
what it records when a swap reached only some replicas."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from taps_ray.config import CaptureConfig, load_config
from taps_ray.serving.capture import CaptureWriter
from taps_ray.serving.promote import PromotionLog
from taps_ray.train import watch as watch_module
from taps_ray.train.adapt import AdaptResult, next_version
from taps_ray.train.watch import Watch

FINGERPRINT = {"name": "fake", "hidden_size": 8, "vocab_size": 32, "embed_hash": "0"}
EVERY = 5


def capture(folder: Path, requests: int = EVERY) -> None:
    """``requests`` more token-id rows in the capture folder ``folder``."""
    cfg = CaptureConfig(enabled=True, dir=str(folder), rows_per_shard=requests, mode="all")
    writer = CaptureWriter(cfg, folder, FINGERPRINT)
    for i in range(requests):
        writer.add([2, 3], [4 + i % 5, 5], None, f"{i:064x}", "single", "stop", {})
    writer.flush()


class FakeAdapt:
    """``run_adapt``: writes the next ``adapt-vN`` folder, whose traffic tau gains the next of ``gains``."""

    def __init__(self, gains: list[float]):
        self.gains, self.sources = list(gains), []

    def __call__(self, cfg, traffic, source, target=None) -> AdaptResult:
        version = next_version(cfg.run_dir, {})
        out = cfg.run_dir / "drafters" / f"adapt-v{version}"
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"weights")
        self.sources.append(source)
        gain = self.gains.pop(0)
        return AdaptResult(out, version, {"tau": {"traffic": {"before": 1.0, "after": 1.0 + gain}},
                                          "traffic_rows": 4})


class FakeServed:
    """A :class:`~taps_ray.train.watch.PromotionTarget` whose replicas all take every swap."""

    def __init__(self, checkpoint: str):
        self.checkpoint, self.promoted, self.swaps = checkpoint, None, []

    def serving(self) -> str:
        return self.checkpoint

    def swap(self, checkpoint: str) -> None:
        self.checkpoint = self.promoted = checkpoint
        self.swaps.append(checkpoint)

    def reconcile(self) -> int:
        return 0


def experiment(tmp_path: Path, *overrides: str):
    source = tmp_path / "source"
    source.mkdir(exist_ok=True)
    return load_config(None, [f"output_dir={tmp_path / 'runs'}", "name=w", f"adapt.every={EVERY}",
                              "adapt.poll_s=0.01", "train.heldout_rows=2",
                              f"serve.drafters={{a: {{checkpoint: {source}}}}}", *overrides])


def kept(cfg) -> tuple[list[str], list[str]]:
    """The version folders and traffic snapshots in the run folder, by name."""
    return (sorted(p.name for p in (cfg.run_dir / "drafters").iterdir()),
            sorted(p.name for p in (cfg.run_dir / "adapt").glob("traffic-*")))


def test_the_loop_keeps_the_last_promoted_versions_the_newest_and_the_configured_and_one_snapshot(
        tmp_path, monkeypatch):
    """keep=2: a kept-aside version goes once a newer round ran, a promoted one once two newer ones were
    promoted; the version another served drafter is configured with stays; only the newest round's
    traffic snapshot stays; a folder a crash left mid-prune is removed; keep=1 keeps only the serving one."""
    drafters = tmp_path / "runs" / "w" / "drafters"
    cfg = experiment(tmp_path, f"serve.drafters.b={{checkpoint: {drafters / 'adapt-v2'}}}")
    fake = FakeAdapt([1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    monkeypatch.setattr(watch_module, "run_adapt", fake)
    traffic = tmp_path / "capture"
    served = FakeServed(str(tmp_path / "source"))
    loop = Watch(cfg, "a", served, traffic)
    seen = []
    for _ in range(5):
        capture(traffic)
        loop.round(loop.due())
        seen.append(kept(cfg))
        if len(seen) == 3:
            (drafters / ".adapt-v0.pruned").mkdir()  # what a prune killed between rename and delete leaves
    assert seen == [
        (["adapt-v1"], ["traffic-5"]),
        (["adapt-v1", "adapt-v2"], ["traffic-10"]),  # promoted v1, newest v2 (kept aside)
        (["adapt-v1", "adapt-v2", "adapt-v3"], ["traffic-15"]),  # v2 stays: drafter b is configured with it
        (["adapt-v2", "adapt-v3", "adapt-v4"], ["traffic-20"]),  # promoted v3, v4: v1 is superseded twice
        (["adapt-v2", "adapt-v3", "adapt-v4", "adapt-v5"], ["traffic-25"]),
    ]
    assert served.promoted == str(drafters / "adapt-v4") and fake.sources[-1] == served.promoted
    assert [e["version"] for e in PromotionLog(cfg.run_dir).entries()] == [1, 2, 3, 4, 5]

    one = Watch(experiment(tmp_path, "adapt.keep=1"), "a", served, traffic)
    capture(traffic)
    one.round(one.due())
    assert kept(cfg) == (["adapt-v4", "adapt-v6"], ["traffic-30"])
    assert served.checkpoint == str(drafters / "adapt-v4")


def test_a_failed_round_keeps_its_snapshot_and_prunes_older_ones(tmp_path, monkeypatch, caplog):
    from taps_ray.train.adapt import AdaptError

    cfg = experiment(tmp_path)
    calls = []

    def failing(cfg, traffic, source, target=None):
        calls.append(Path(traffic).name)
        raise AdaptError("no features")

    monkeypatch.setattr(watch_module, "run_adapt", failing)
    traffic = tmp_path / "capture"
    loop = Watch(cfg, "a", FakeServed(str(tmp_path / "source")), traffic)
    with caplog.at_level(logging.ERROR, logger=watch_module.__name__):
        for _ in range(2):
            capture(traffic)
            assert loop.round(loop.due()) is None
    assert calls == ["traffic-5", "traffic-10"] and "no features" in caplog.text
    assert sorted(p.name for p in (cfg.run_dir / "adapt").glob("traffic-*")) == ["traffic-10"]


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_must_be_at_least_one(tmp_path, keep):
    from taps_ray.config import ConfigError

    with pytest.raises(ConfigError, match="adapt.keep"):
        experiment(tmp_path, f"adapt.keep={keep}")
