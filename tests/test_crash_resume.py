"""``kill -9`` at random points: a training run, a sweep and an evaluation, each killed from outside
(a subprocess, ``os.kill(pid, SIGKILL)`` after a seeded random amount of progress and a seeded random
delay), then resumed, end exactly where an uninterrupted run ends: the same checkpoints and step
counts, the same records, nothing lost and nothing duplicated (:mod:`taps_ray.runstate`). The training
run and the sweep are killed twice, the second time while resuming from the first kill, then resumed
to the end.

The subprocess drivers join this session's Ray cluster (``ray_session``), so a kill costs no cluster
start; Ray ends a dead driver's workers and actors.
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from taps_ray.config import load_config
from taps_ray.eval import runner
from taps_ray.eval.records import RECORDS, read_records, record_key
from taps_ray.models.drafter import DraftHead
from taps_ray.runstate import read_jsonl
from tests.conftest import REPO
from tests.train.train_helpers import drafter_tensors, tiny_experiment

pytestmark = pytest.mark.slow

TRAIN_SEEDS = [11]
SWEEP_SEEDS = [21]
EVAL_SEEDS = [31, 32, 33]
EAGLE = {"name": "a", "algorithm": "eagle2", "mixture": "math-only"}
STEPS = 12  # 24 rows / batch 4 = 6 steps per epoch, 2 epochs; checkpoints every 3 steps


def _env(ray_session, cache: Path | None = None) -> dict:
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address, "PYTHONPATH": str(REPO)}
    if cache is not None:
        env["TAPS_CACHE"] = str(cache)
    return env


def _kill_when(cmd: list[str], env: dict, progress, target: int, delay: float, log: Path,
               timeout: float = 300, poll: float = 0.05) -> bool:
    """Run ``cmd``; once ``progress()`` reaches ``target``, wait ``delay`` seconds and SIGKILL it. True
    when it was killed (False: it finished first)."""
    with log.open("a") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    try:
        while proc.poll() is None and progress() < target:
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(poll)
        time.sleep(delay)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            time.sleep(2.0)  # Ray ends the dead driver's workers
            return True
        assert proc.returncode == 0, log.read_text()[-3000:]
        return False
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(cmd: list[str], env: dict, log: Path, timeout: float = 400) -> None:
    with log.open("a") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, log.read_text()[-4000:]


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


# -- training -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def train_experiment(tmp_path_factory, ray_session):
    """A one-variant experiment and its uninterrupted run (in this process)."""
    from taps_ray.train.launch import run_training

    tmp = tmp_path_factory.mktemp("crash_train")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAPS_CACHE", str(tmp / "cache"))
        path, target = tiny_experiment(tmp, [EAGLE])
        summary = run_training(load_config(path), target=target)
    assert [(r.variant, r.status) for r in summary.variants] == [("a", "ok")]
    return tmp, path, load_config(path).run_dir / "drafters" / "a"


def _metric_steps(folder: Path) -> list[tuple]:
    return [(r["kind"], r["step"]) for r in read_jsonl(folder / "metrics.jsonl")]


def _records_since(path: Path, since: float) -> int:
    """Records of ``metrics.jsonl`` written at or after ``since`` (a resumed run's own progress: it cuts
    the file back to its checkpoint, so the line count alone can stand above where it resumed)."""
    return sum(1 for r in read_jsonl(path) if r.get("time", 0.0) >= since)


@pytest.mark.parametrize("seed", TRAIN_SEEDS)
def test_training_killed_at_random_points_resumes_to_the_same_drafter(train_experiment, ray_session, seed):
    """Killed after 0-5 metrics records, then killed again after 0-2 records of the run resuming from
    that kill (a fresh run writes 8, one resuming from step 9 still 3), then resumed to the end."""
    tmp, path, reference = train_experiment
    rng = random.Random(seed)
    runs = tmp / f"killed{seed}"
    out = runs / "tiny" / "drafters" / "a"
    cmd = [sys.executable, "-m", "taps_ray.cli", "train", str(path), f"output_dir={runs}", "--resume"]
    env, log = _env(ray_session, tmp / "cache"), tmp / f"train{seed}.log"
    for kill, records in enumerate((rng.randint(0, 5), rng.randint(0, 2))):
        since = time.time()
        killed = _kill_when(cmd, env, lambda since=since: _records_since(out / "metrics.jsonl", since), records,
                            rng.uniform(0, 0.3), log, poll=0.01)
        assert killed and "a ok in" not in log.read_text(), f"kill {kill + 1}: the run finished first: nothing was tested"
    _run(cmd, env, log)
    meta = json.loads((out / "config.json").read_text())
    assert meta["training"]["final"] and meta["training"]["step"] == STEPS
    assert all(a["start_step"] % 3 == 0 for a in meta["training"]["attempts"]), "resumed off a checkpoint"
    steps = _metric_steps(out)
    assert steps == _metric_steps(reference) and len(set(steps)) == len(steps), "a step was lost or logged twice"
    got, expected = drafter_tensors(out), drafter_tensors(reference)
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    assert json.loads((out / "variant.json").read_text()) == json.loads((reference / "variant.json").read_text())
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


# -- sweep ----------------------------------------------------------------------------------------

ALPHAS = [1.0, 0.75, 0.5, 0.25, 0.0]


@pytest.fixture(scope="module")
def sweep_experiment(tmp_path_factory, ray_session):
    """An interpolation sweep of two random drafters and its uninterrupted run (in a subprocess)."""
    tmp = tmp_path_factory.mktemp("crash_sweep")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAPS_CACHE", str(tmp / "cache"))
        path, target = tiny_experiment(tmp, [])
    drafters = {}
    for name, seed in (("one", 1), ("two", 2)):
        drafters[name] = str(DraftHead(target.config, seed=seed).save(tmp / name, target.fingerprint))
    spec = {"name": "interp", "kind": "interpolation", "drafters": drafters, "search": {"alpha": ALPHAS},
            "eval": {"prompts": {"math": {"source": "heldout", "limit": 2}, "chat": {"source": "heldout", "limit": 2}},
                     "max_new_tokens": 8, "tree": {"depth": 2, "top_k": 3, "total_tokens": 6}},
            "resources": {"threads": 1, "max_concurrent_trials": 1}}
    spec_path = tmp / "interp.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    reference = tmp / "reference"
    _run(_sweep_cmd(spec_path, path, reference, resume=False), _env(ray_session, tmp / "cache"), tmp / "ref.log")
    return tmp, spec_path, path, reference


def _sweep_cmd(spec: Path, config: Path, out: Path, resume: bool = True) -> list[str]:
    return [sys.executable, "-m", "taps_ray.cli", "sweep", str(spec), str(config), "--out", str(out),
            *(["--resume"] if resume else [])]


def _sweep_rows(out: Path) -> dict[float, dict]:
    with (out / "results.csv").open() as f:
        return {float(r["alpha"]): r for r in csv.DictReader(f)}


def _started_trials(out: Path) -> int:
    return len(list((out / "trials").glob("*/attempts.jsonl")))


@pytest.mark.parametrize("seed", SWEEP_SEEDS)
def test_sweep_killed_at_random_points_resumes_to_the_same_results(sweep_experiment, ray_session, seed):
    """Killed once 1-3 of the 5 trials have started, then killed again once 1-2 more have started in the
    sweep resuming from that kill, then resumed to the end."""
    tmp, spec, config, reference = sweep_experiment
    rng = random.Random(seed)
    out = tmp / f"killed{seed}"
    env, log = _env(ray_session, tmp / "cache"), tmp / f"sweep{seed}.log"
    target = rng.randint(1, len(ALPHAS) - 2)
    for kill in range(2):
        killed = _kill_when(_sweep_cmd(spec, config, out), env, lambda: _started_trials(out), target,
                            rng.uniform(0, 0.3), log, poll=0.01)
        assert killed and not (out / "results.csv").exists(), (
            f"kill {kill + 1}: the sweep finished first: nothing was tested")
        target = min(_started_trials(out) + rng.randint(1, 2), len(ALPHAS))
    _run(_sweep_cmd(spec, config, out), env, log)
    rows, expected = _sweep_rows(out), _sweep_rows(reference)
    assert sorted(rows) == sorted(ALPHAS), "a trial was lost or run twice"
    assert all(r["status"] == "ok" for r in rows.values()), rows
    columns = [c for c in expected[1.0] if c.startswith(("tau/", "tau_per_question/", "steps/"))] + ["objective"]
    assert columns and {a: [r[c] for c in columns] for a, r in rows.items()} == {
        a: [r[c] for c in columns] for a, r in expected.items()}
    for alpha, row in rows.items():
        got, want = drafter_tensors(Path(row["drafter"])), drafter_tensors(Path(expected[alpha]["drafter"]))
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
    best = json.loads((out / "best.json").read_text())
    assert best["config"] == json.loads((reference / "best.json").read_text())["config"]


# -- evaluation -----------------------------------------------------------------------------------

EVAL_SCRIPT = """
import sys
from taps_ray.config import load_config
from taps_ray.eval.runner import run_eval
from tests.test_crash_resume import EVAL_OVERRIDES, eval_questions, eval_target
run_eval(load_config(None, EVAL_OVERRIDES), sys.argv[1], questions=eval_questions(), target_factory=eval_target,
         report=False)
"""
EVAL_OVERRIDES = ["tree.depth=2", "tree.top_k=3", "tree.total_tokens=8", "tree.lookup_tokens=0",
                  "eval.max_new_tokens=10", "eval.num_actors=0", "eval.benchmarks=[mt_bench, gsm8k]",
                  "eval.temperatures=[0, 1]", "eval.strategies=[single, averaged]",
                  "eval.drafters={math: 'random:0', chat: 'random:1'}"]


def eval_questions():
    from taps_ray.data.benchmarks import BenchmarkQuestion

    return {"mt_bench": [BenchmarkQuestion(81, "writing", ["Write a travel blog post.", "Rewrite it in one line."],
                                           "mt_bench")],
            "gsm8k": [BenchmarkQuestion(i, "gsm8k", [f"What is {i} + {2 * i + 3}?"], "gsm8k") for i in range(3)]}


def eval_target():
    from tests.eval.eval_helpers import chat_tiny_target

    return chat_tiny_target(0)


def _outcome(record: dict) -> tuple:
    """What a resumed run reproduces (tests/eval/test_runner.py ``outcome``): a production record's steps
    follow measured timings, so only its greedy output."""
    if record.get("method") == "production":
        return record["output_crc"] if record["temperature"] == 0 else None
    return record["output_crc"], record["output_ids"], record["accepted"], record["steps"]


@pytest.fixture(scope="module")
def eval_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("crash_eval") / "reference"
    runner.run_eval(load_config(None, EVAL_OVERRIDES), out, questions=eval_questions(), target_factory=eval_target,
                    report=False)
    return out, {record_key(r): _outcome(r) for r in read_records(out)}


@pytest.mark.parametrize("seed", EVAL_SEEDS)
def test_evaluation_killed_at_a_random_point_resumes_to_the_same_records(eval_reference, tmp_path, seed):
    _, expected = eval_reference
    rng = random.Random(seed)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-c", EVAL_SCRIPT, str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    total = len(expected)
    killed = _kill_when(cmd, env, lambda: _lines(out / RECORDS), rng.randint(0, total - 8), rng.uniform(0, 0.3),
                        tmp_path / "eval.log")
    assert killed and _lines(out / RECORDS) < total, "the evaluation finished before the kill: nothing was tested"
    runner.run_eval(load_config(None, EVAL_OVERRIDES), out, questions=eval_questions(), target_factory=eval_target,
                    report=False)
    lines = [json.loads(line) for line in (out / RECORDS).read_text().splitlines()]
    keys = [record_key(r) for r in lines]
    assert len(keys) == len(set(keys)) == total, "a record was lost or written twice"
    assert {record_key(r): _outcome(r) for r in read_records(out)} == expected
