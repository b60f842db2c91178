"""benchmarks/cpu_by_process.py: a command's CPU summed by the kind of process that spent it."""

from __future__ import annotations

import sys

import pytest

from benchmarks.cpu_by_process import main, process_kind, sample

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_process_kinds_name_ray_workers_daemons_and_the_rest():
    assert process_kind("ray::ServeReplica:app:Verifier.handle_request") == "ray::ServeReplica:app:Verifier"
    assert process_kind("ray::IDLE") == "ray::IDLE"
    assert process_kind("/venv/lib/ray/core/src/ray/raylet/raylet --node-ip=1") == "raylet"
    assert process_kind("python -m pytest -q tests") == "pytest"
    assert process_kind("x" * 80) == "x" * 60


def test_a_busy_child_is_counted_and_the_sampler_itself_is_not(tmp_path):
    result = sample([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], interval_s=0.05)
    assert result["returncode"] == 0 and result["wall_s"] > 0
    kinds = {kind: cpu for kind, cpu, _ in result["by_kind"]}
    assert any("sum(i * i" in kind and cpu > 0.05 for kind, cpu in kinds.items()), kinds
    assert main(["--out", str(tmp_path / "cpu.json"), "--", sys.executable, "-c", "pass"]) == 0
    assert (tmp_path / "cpu.json").exists()
    with pytest.raises(SystemExit):
        main([])
