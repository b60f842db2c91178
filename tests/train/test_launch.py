"""``taps train`` end to end on a tiny random target, submitted as a Ray job (``ray job submit --working-dir .
-- taps train CONFIG``) to a private head node the module starts: two variants train concurrently, one
survives an injected failure by resuming from its last checkpoint, outputs are never overwritten
silently, and input problems are one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from taps_ray import cli
from taps_ray.config import load_config
from taps_ray.data.contamination import TRAINED_PROMPTS, prompt_hash, write_feature_prompts
from taps_ray.data.feature_sets import FeatureSet
from taps_ray.data.mixtures import MixtureSelection
from taps_ray.models.drafter import DraftHead
from taps_ray.runtime.faults import TRAIN_DELAY_ENV
from taps_ray.runtime.faults import TRAIN_ENV as FAIL_ENV
from taps_ray.train.launch import TrainLaunchError, run_training
from taps_ray.train.variant import trained_prompts
from tests.conftest import REPO
from tests.train.train_helpers import drafter_tensors, tiny_experiment

HASS = {"algorithm": "hass", "mixture": "math-only", "objective": {"hass_passes": 2, "topk_weight": 0.0},
        "train": {"stage2": {"epochs": 1, "lr": 5e-4, "topk_weight": 1.0}}}
STEPS = 18  # 24 rows / batch 4 = 6 steps per epoch; 2 epochs of stage 1 + 1 of stage 2
STEP_DELAY_S = 0.5  # a variant trains for >= 9 s, so two variants run concurrently only if launched together
FAIL_AT = 11  # checkpoints every 3 steps: the run resumes at step 9, mid-epoch 2


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """Tiny target folder, math/chat feature sets and a config with variants ``a`` and ``b``
    (identical settings); ``$TAPS_CACHE`` points at the fixture's features for the module."""
    tmp = tmp_path_factory.mktemp("launch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAPS_CACHE", str(tmp / "cache"))
        path, target = tiny_experiment(tmp, [{"name": "a", **HASS}, {"name": "b", **HASS}])
        yield path, target


@pytest.fixture(scope="module")
def trained(experiment):
    """Variants ``a`` (failing once before step ``FAIL_AT``) and ``b``, each step slowed by ``STEP_DELAY_S``,
    trained by a Ray job on a private head node (:func:`submit_training`): (config, target, the run's ``train_summary.json``, the job's output and
    the statuses of the cluster's jobs)."""
    path, target = experiment
    output, statuses = submit_training(path, {FAIL_ENV: f"a:{FAIL_AT}", TRAIN_DELAY_ENV: str(STEP_DELAY_S)})
    cfg = load_config(path)
    return cfg, target, json.loads((cfg.run_dir / "train_summary.json").read_text()), output, statuses


def _error_line(capsys) -> str:
    """The CLI's error: exactly one stderr line starting with ``taps train: error:``."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("taps train: error:")]
    assert len(lines) == 1, lines
    return lines[0]


def _records(cfg, variant):
    path = cfg.run_dir / "drafters" / variant / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.ray
def test_ray_job_submit_trains_the_variants(trained):
    """``ray job submit --working-dir . -- taps train CONFIG`` against a private head node succeeds and
    prints the summary table."""
    _, _, _, output, statuses = trained
    assert "succeeded" in output and "| a | hass | math-only |" in output and "| b | hass | math-only |" in output
    assert statuses == ["SUCCEEDED"]


@pytest.mark.ray
def test_variants_train_concurrently_into_loadable_drafters(trained):
    cfg, target, summary, _, _ = trained
    assert [(r["variant"], r["status"], r["steps"]) for r in summary["variants"]] == [("a", "ok", STEPS),
                                                                                     ("b", "ok", STEPS)]
    for name in ("a", "b"):
        out = cfg.run_dir / "drafters" / name
        head = DraftHead.load(out, target.config, target.fingerprint)
        assert head.draft_vocab_size == 48 and set(target.eos_token_ids) <= set(head.draft_to_target.tolist())
        meta = json.loads((out / "config.json").read_text())
        assert meta["training"]["final"] and meta["training"]["step"] == STEPS and meta["name"] == name
        assert meta["mixture"]["counts"] == {"math": 24} and meta["metrics"]["heldout/math/acc1"] >= 0
    alive = {}
    for name in ("a", "b"):
        meta = json.loads((cfg.run_dir / "drafters" / name / "config.json").read_text())
        alive[name] = (meta["training"]["attempts"][0]["time"], _records(cfg, name)[-1]["time"])
    assert alive["a"][0] < alive["b"][1] and alive["b"][0] < alive["a"][1], f"workers never ran together: {alive}"


@pytest.mark.ray
def test_drafters_record_the_prompts_of_the_feature_sets_they_drew_from(trained):
    cfg, _, _, _, _ = trained
    math = {prompt_hash(f"math question {i}") for i in range(36)}
    for name in ("a", "b"):
        record = json.loads((cfg.run_dir / "drafters" / name / TRAINED_PROMPTS).read_text())
        assert set(record["sha256"]) == math and record["count"] == 36 and record["sources"] == ["math: synthetic math"]


def test_trained_prompts_union_skips_empty_and_unrecorded_sets(tmp_path, caplog):
    sets = {}
    for name, prompts in (("math", ["m1", "m2"]), ("chat", ["c1"]), ("code", None)):
        (tmp_path / name).mkdir()
        if prompts:
            write_feature_prompts(tmp_path / name, [prompt_hash(p) for p in prompts])
        sets[name] = FeatureSet(name, tmp_path / name, {"origin": f"origin of {name}", "rows": 2})
    rows = {"math": np.array([0, 1]), "chat": np.array([], dtype=np.int64), "code": np.array([1])}
    record = trained_prompts(sets, MixtureSelection("mix", rows))
    assert set(record["sha256"]) == {prompt_hash("m1"), prompt_hash("m2")}
    assert record["sources"] == ["math: origin of math"]
    assert "features of 'code'" in caplog.text and "record no prompts" in caplog.text


@pytest.mark.ray
def test_injected_failure_resumes_from_last_checkpoint_without_retraining(trained):
    cfg, _, _, _, _ = trained
    meta = {n: json.loads((cfg.run_dir / "drafters" / n / "config.json").read_text()) for n in ("a", "b")}
    assert [a["start_step"] for a in meta["a"]["training"]["attempts"]] == [0, 9]
    assert [a["start_step"] for a in meta["b"]["training"]["attempts"]] == [0]
    steps = {n: [(r["kind"], r["step"]) for r in _records(cfg, n)] for n in ("a", "b")}
    assert steps["a"] == steps["b"] and len(set(steps["a"])) == len(steps["a"])
    assert steps["a"][-1] == ("eval", STEPS)
    a, b = drafter_tensors(cfg.run_dir / "drafters" / "a"), drafter_tensors(cfg.run_dir / "drafters" / "b")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert (cfg.run_dir / "drafters" / "a" / ".injected_failure.rank0").exists()
    assert not (cfg.run_dir / "drafters" / "b" / ".injected_failure.rank0").exists()


@pytest.mark.ray
def test_existing_run_is_refused_unless_resumed(trained, experiment, capsys):
    cfg, target, _, _, _ = trained
    weights = cfg.run_dir / "drafters" / "a" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    with pytest.raises(TrainLaunchError, match="--resume .* --force"):
        run_training(cfg, target=target)
    assert cli.main(["train", str(experiment[0]), "--variants", "b"]) == 2
    assert "already holds variant(s) ['b']" in _error_line(capsys)
    resumed = run_training(cfg, mode="resume", target=target)
    assert resumed.variants == [] and weights.stat().st_mtime_ns == before
    saved = json.loads((cfg.run_dir / "train_summary.json").read_text())
    assert [v["variant"] for v in saved["variants"]] == ["a", "b"]


@pytest.mark.parametrize(("override", "message"), [
    ("variants=[{name: x, mixture: nope}]", "unknown mixture 'nope'; valid mixtures: ['math-only', 'mixed']"),
    ("mixtures.math-only={counts: {math: 99}}", "asks for 99 rows of 'math' but only 30 training rows exist"),
    ("data.features.max_len=65", "missing or incomplete; run `taps prepare`"),
    ("--variants=zzz", "unknown variant(s) ['zzz']; variants in config: ['a', 'b']"),
])
def test_input_problems_are_one_line_errors(experiment, capsys, override, message):
    args = ["train", str(experiment[0])] + ([override] if not override.startswith("--") else [override])
    assert cli.main(args) == 2
    assert message in _error_line(capsys)


def test_unwritable_output_dir(experiment, capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["train", str(experiment[0]), f"output_dir={blocker}/runs"]) == 2
    assert "is not writable" in _error_line(capsys)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def submit_training(path: Path, extra_env: dict[str, str]) -> tuple[str, list[str]]:
    """``ray job submit --working-dir . -- taps train CONFIG`` against a private head node (3 CPUs, with
    the job server), ``extra_env`` set in the cluster's environment; the cluster is stopped after. Returns
    the job's output and the statuses of the cluster's jobs; fails when the job does."""
    gcs, dashboard, client, agent, agent_grpc, metrics, runtime_env, node_mgr, obj_mgr = _free_ports(9)
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    bin_dir = str(Path(sys.executable).parent)
    head_log = path.parent / "ray_start.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # the job is over: no 30 s drain on the way out
           "TAPS_CACHE": os.environ["TAPS_CACHE"], **extra_env}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [f"{bin_dir}/ray", "start", "--head", "--block", f"--port={gcs}", f"--temp-dir={temp_dir}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={runtime_env}", f"--node-manager-port={node_mgr}",
         f"--object-manager-port={obj_mgr}", "--num-cpus=3", "--disable-usage-stats"],
        env=env, stdout=head_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        from ray.job_submission import JobSubmissionClient

        client_ = None
        for _ in range(90):
            assert head.poll() is None, head_log.read_text()
            try:
                client_ = JobSubmissionClient(address)
                break
            except Exception:
                time.sleep(1)
        assert client_ is not None, "job server did not come up"
        submit = subprocess.run(
            [f"{bin_dir}/ray", "job", "submit", f"--address={address}", "--working-dir", ".", "--",
             "taps", "train", str(path)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
        assert submit.returncode == 0, submit.stdout[-4000:]
        return submit.stdout + submit.stderr, [j.status.value for j in client_.list_jobs()]
    finally:
        head.send_signal(signal.SIGTERM)  # the head alone shuts its processes down; the group is killed after
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)
