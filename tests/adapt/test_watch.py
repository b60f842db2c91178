"""The ``taps adapt --watch`` loop around its training and its swap (both faked here; the end-to-end loop is in
``test_finetune.py``): what it prunes after a round, how it shares the run folder with other commands, and
what it records when a swap reached only some replicas."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from taps_ray.adapt import watch as watch_module
from taps_ray.adapt.finetune import AdaptError, AdaptResult, next_version
from taps_ray.adapt.promote import PartialSwap, PromotionLog
from taps_ray.adapt.watch import Watch
from taps_ray.config import load_config
from taps_ray.config_serve import CaptureConfig
from taps_ray.data.capture import CaptureWriter
from taps_ray.runstate import FolderLocked
from taps_ray.train.variant import TrainLaunchError

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
    """A :class:`~taps_ray.adapt.watch.PromotionTarget` whose replicas all take every swap."""

    def __init__(self, checkpoint: str):
        self.checkpoint, self.promoted, self.swaps = checkpoint, None, []

    def serving(self) -> str:
        return self.checkpoint

    def swap(self, checkpoint: str) -> None:
        self.checkpoint = self.promoted = checkpoint
        self.swaps.append(checkpoint)

    def reconcile(self) -> int:
        return 0


def experiment_overrides(tmp_path: Path, *overrides: str) -> list[str]:
    source = tmp_path / "source"
    source.mkdir(exist_ok=True)
    return [f"output_dir={tmp_path / 'runs'}", "name=w", f"adapt.every={EVERY}", "adapt.poll_s=0.01",
            "train.heldout_rows=2", f"serve.drafters={{a: {{checkpoint: {source}}}}}", *overrides]


def experiment(tmp_path: Path, *overrides: str):
    return load_config(None, experiment_overrides(tmp_path, *overrides))


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


@pytest.mark.parametrize("error", [AdaptError("no features"), TrainLaunchError("no features")])
def test_a_failed_round_keeps_its_snapshot_and_prunes_older_ones(tmp_path, monkeypatch, caplog, error):
    cfg = experiment(tmp_path)
    calls = []

    def failing(cfg, traffic, source, target=None):
        calls.append(Path(traffic).name)
        raise error

    monkeypatch.setattr(watch_module, "run_adapt", failing)
    traffic = tmp_path / "capture"
    loop = Watch(cfg, "a", FakeServed(str(tmp_path / "source")), traffic)
    with caplog.at_level(logging.ERROR, logger=watch_module.__name__):
        for _ in range(2):
            capture(traffic)
            assert loop.round(loop.due()) is None
    assert calls == ["traffic-5", "traffic-10"] and "no features" in caplog.text
    assert sorted(p.name for p in (cfg.run_dir / "adapt").glob("traffic-*")) == ["traffic-10"]
    assert loop.baseline == 10 and loop.due() is None


def hold(code: str) -> subprocess.Popen:
    """A process running ``code``, once it printed its first line."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_due_round_waits_for_a_locked_run_folder_says_so_once_and_runs_once_it_is_free(
        tmp_path, monkeypatch, caplog):
    cfg = experiment(tmp_path, "adapt.rounds=1")
    fake = FakeAdapt([1.0])
    monkeypatch.setattr(watch_module, "run_adapt", fake)
    traffic = tmp_path / "capture"
    capture(traffic)
    holder = hold("import time\nfrom taps_ray.runstate import folder_lock\n"
                  f"with folder_lock({str(cfg.run_dir)!r}, 'taps train'):\n    print('held', flush=True)\n"
                  "    time.sleep(120)\n")
    done = []
    try:
        with caplog.at_level(logging.INFO, logger=watch_module.__name__):
            loop = threading.Thread(target=lambda: done.extend(Watch(cfg, "a", FakeServed(
                str(tmp_path / "source")), traffic).run()), daemon=True)
            loop.start()
            loop.join(1.0)  # 100 polls
            assert loop.is_alive() and not done and fake.sources == []
            assert not list((cfg.run_dir / "adapt").glob("traffic-*"))
            holder.kill()
            holder.wait()
            loop.join(30)
    finally:
        holder.kill()
    assert not loop.is_alive() and len(done) == 1 and done[0].promoted and len(fake.sources) == 1
    waits = [r.getMessage() for r in caplog.records if "waits for the run folder" in r.getMessage()]
    assert len(waits) == 1 and f"pid {holder.pid}" in waits[0] and "taps train" in waits[0]
    assert "the run folder is free again" in caplog.text


def test_a_lock_training_finds_held_defers_the_round_instead_of_ending_the_loop(tmp_path, monkeypatch):
    cfg = experiment(tmp_path, "adapt.rounds=1")
    fake = FakeAdapt([1.0])
    attempts = []

    def busy_once(cfg, traffic, source, target=None):
        attempts.append(Path(traffic).name)
        if len(attempts) == 1:
            raise FolderLocked("features/math is in use by pid 1 (taps prepare)")
        return fake(cfg, traffic, source, target)

    monkeypatch.setattr(watch_module, "run_adapt", busy_once)
    traffic = tmp_path / "capture"
    capture(traffic)
    done = Watch(cfg, "a", FakeServed(str(tmp_path / "source")), traffic).run()
    assert attempts == ["traffic-5", "traffic-5"] and len(done) == 1 and done[0].captured == EVERY


@pytest.mark.slow
def test_a_second_loop_on_the_same_drafter_and_run_folder_is_refused_naming_the_first(tmp_path, monkeypatch):
    """A loop on another drafter of the same run folder is not: it runs its round."""
    traffic = tmp_path / "capture"
    capture(traffic)
    quiet = experiment_overrides(tmp_path, "adapt.every=1000")
    first = hold("from taps_ray.config import load_config\nfrom taps_ray.adapt.watch import Watch\n"
                 "class Served:\n    promoted = None\n    printed = False\n"
                 "    def reconcile(self):\n        if not self.printed:\n            print('held', flush=True)\n"
                 "        self.printed = True\n        return 0\n"
                 f"Watch(load_config(None, {quiet!r}), 'a', Served(), {str(traffic)!r}).run()\n")
    try:
        monkeypatch.setattr(watch_module, "run_adapt", FakeAdapt([1.0, 1.0]))
        with pytest.raises(FolderLocked, match=f"pid {first.pid} .*taps adapt --watch \\(drafter a\\)"):
            Watch(experiment(tmp_path, "adapt.rounds=1"), "a", FakeServed(str(tmp_path / "source")), traffic).run()
        other = experiment(tmp_path, "adapt.rounds=1", f"serve.drafters.b={{checkpoint: {tmp_path / 'source'}}}")
        assert len(Watch(other, "b", FakeServed(str(tmp_path / "source")), traffic).run()) == 1
    finally:
        first.kill()
        first.wait()


def test_a_version_that_reached_only_some_replicas_is_kept_aside_and_recorded_as_partial(
        tmp_path, monkeypatch, caplog):
    class HalfServed(FakeServed):
        def swap(self, checkpoint: str) -> None:
            if checkpoint.endswith("adapt-v2"):
                raise PartialSwap(f"drafter 'a': partial swap, rolled back: replica(s) ['r1'] took {checkpoint}, "
                                  f"['r2'] did not; every replica serves {self.promoted} again")
            super().swap(checkpoint)

    cfg = experiment(tmp_path)
    monkeypatch.setattr(watch_module, "run_adapt", FakeAdapt([1.0, 1.0]))
    traffic = tmp_path / "capture"
    served = HalfServed(str(tmp_path / "source"))
    loop = Watch(cfg, "a", served, traffic)
    with caplog.at_level(logging.INFO, logger=watch_module.__name__):
        entries = []
        for _ in range(2):
            capture(traffic)
            entries.append(loop.round(loop.due()))
    first, second = entries
    assert first.promoted and not first.partial
    assert not second.promoted and second.partial and "partial swap, rolled back" in second.reason
    log = PromotionLog(cfg.run_dir)
    assert [e["partial"] for e in log.entries()] == [False, True] and log.last_promoted("a") == first.checkpoint
    assert served.promoted == first.checkpoint
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "version 2 kept aside after a partial swap" in warned[0].getMessage()


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_must_be_at_least_one(tmp_path, keep):
    from taps_ray.config import ConfigError

    with pytest.raises(ConfigError, match="adapt.keep"):
        experiment(tmp_path, f"adapt.keep={keep}")
