"""Crash-safe run state (:mod:`taps_ray.runstate`): atomic writes with unique temporary names, JSON-lines
readers that survive a torn last line, folder locks that name their holder and die with it, and the
settings-changed check; plus the fault-injection parsers (:mod:`taps_ray.runtime.faults`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from taps_ray import runstate
from taps_ray.runstate import (
    FolderLocked,
    RunStateError,
    append_jsonl,
    atomic_write,
    changed_settings,
    folder_lock,
    read_jsonl,
    repair_jsonl,
    temp_name,
    write_json,
)
from taps_ray.runtime import faults
from tests.conftest import REPO


def test_atomic_write_replaces_whole_files_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "run.json"
    write_json(path, {"a": 1})
    atomic_write(path, b"\x00binary")
    assert path.read_bytes() == b"\x00binary"
    write_json(path, {"b": [1, 2]})
    assert json.loads(path.read_text()) == {"b": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_temporary_names_are_unique_per_writer(tmp_path):
    path = tmp_path / "state.json"
    names = {temp_name(path) for _ in range(200)}
    assert len(names) == 200 and all(n.parent == tmp_path and str(os.getpid()) in n.name for n in names)


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_json(path, {"old": True})

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(runstate.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True} and len(list(tmp_path.iterdir())) == 1


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    path = tmp_path / "summary.json"
    code = ("import sys\nfrom taps_ray.runstate import write_json\n"
            "for i in range(30):\n    write_json(sys.argv[1], {'worker': sys.argv[2], 'i': i, 'pad': 'x' * 4000})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(w)], cwd=REPO) for w in range(3)]
    while any(p.poll() is None for p in procs):
        if path.exists():
            assert json.loads(path.read_text())["pad"] == "x" * 4000
        time.sleep(0.005)
    assert [p.wait() for p in procs] == [0, 0, 0]
    assert json.loads(path.read_text())["i"] == 29
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_torn_last_line_is_skipped_with_a_warning_and_cut_before_appending(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, [{"step": 1}, {"step": 2}])
    with path.open("a") as handle:
        handle.write('{"step": 3, "lo')  # a writer killed mid-line
    with caplog.at_level(logging.WARNING, logger="taps_ray.runstate"):
        assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert "torn last line" in caplog.text
    append_jsonl(path, [{"step": 3}])
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    assert path.read_text().count("\n") == 3


def test_a_complete_but_unparsable_last_line_is_torn_too(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    assert read_jsonl(path) == [{"a": 1}]
    assert repair_jsonl(path) and path.read_text() == '{"a": 1}\n'
    assert not repair_jsonl(path) and read_jsonl(tmp_path / "missing.jsonl") == []


def test_damage_before_the_last_line_is_an_error(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(RunStateError, match="line 2"):
        read_jsonl(path)
    assert read_jsonl(path, skip_damaged=True) == [{"a": 1}, {"a": 2}]


def test_changed_settings_name_each_nested_key_with_both_values():
    old = {"train": {"lr": 0.1, "epochs": 2}, "target": "t", "tree": [1, 2]}
    new = {"train": {"lr": 0.2, "epochs": 2}, "target": "t", "tree": (1, 2), "extra": None}
    assert changed_settings(old, new) == ["train.lr: 0.1 in the folder, 0.2 now"]
    assert changed_settings(old, {**old, "target": "u"}) == ["target: 't' in the folder, 'u' now"]


def test_a_held_folder_names_its_holder_and_is_reentrant(tmp_path):
    with folder_lock(tmp_path, "taps eval"):
        with folder_lock(tmp_path, "taps eval (nested)"):
            pass
        code = ("import sys\nfrom taps_ray.runstate import folder_lock\n"
                f"with folder_lock({str(tmp_path)!r}, 'second'):\n    pass\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
        assert proc.returncode != 0
        assert f"pid {os.getpid()}" in proc.stderr and "taps eval" in proc.stderr and "FolderLocked" in proc.stderr
    with folder_lock(tmp_path, "again"):  # released when the block ended
        pass


def test_a_lock_dies_with_its_holder(tmp_path):
    code = ("import sys, time\nfrom taps_ray.runstate import folder_lock\n"
            f"with folder_lock({str(tmp_path)!r}, 'doomed'):\n    print('held', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(FolderLocked, match=f"pid {proc.pid} .*doomed"):
            with folder_lock(tmp_path, "taps train"):
                pass
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with folder_lock(tmp_path, "taps train"):  # the stale lock file of a dead pid does not block
        assert json.loads((tmp_path / runstate.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_threads_of_one_process_share_the_lock(tmp_path):
    errors = []

    def enter():
        try:
            with folder_lock(tmp_path, "thread"):
                pass
        except FolderLocked as err:  # pragma: no cover - the failure being tested for
            errors.append(err)

    with folder_lock(tmp_path, "main"):
        thread = threading.Thread(target=enter)
        thread.start()
        thread.join()
    assert not errors


def test_fault_parsers():
    assert faults.fail_at_step("a:11,b:3", "b") == 3 and faults.fail_at_step("4", "x") == 4
    assert faults.fail_at_step(None, "a") is None
    faults.trial_fault("alpha=0.5", {"alpha": 0.25})
    with pytest.raises(faults.InjectedTrialFailure):
        faults.trial_fault("alpha=0.5", {"alpha": 0.5})
    faults.drafter_fault(None, "d")
    with pytest.raises(faults.InjectedFailure, match="drafter d"):
        faults.drafter_fault("raise", "d")


def test_taps_average_refuses_to_replace_a_folder_that_is_not_a_drafter(tmp_path, capsys):
    from taps_ray import cli

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    code = cli.main(["average", str(REPO / "configs" / "demo.yaml"), "--drafter", "a", "--drafter", "b", "--out",
                     str(precious)])
    assert code == 2 and "not a drafter checkpoint" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "keep me"


def test_taps_average_refuses_an_out_folder_that_is_one_of_its_inputs(tmp_path, capsys, monkeypatch):
    """Averaging into an input would replace it and drop its trained-prompt list (the contamination guard)."""
    from taps_ray import cli
    from taps_ray.models.target import TargetModel

    monkeypatch.setattr(TargetModel, "load", lambda *a, **k: pytest.fail("loaded the target for a refused --out"))
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path)
    for out in ("a", str(tmp_path / "a"), "./a/"):
        code = cli.main(["average", str(REPO / "configs" / "demo.yaml"), "--drafter", "a", "--drafter",
                         "release:math", "--out", out])
        assert code == 2 and "is one of the --drafter inputs" in capsys.readouterr().err


def test_drafter_save_refuses_a_foreign_folder(tmp_path, tiny_target):
    from taps_ray.models.drafter import DrafterSaveError, is_drafter_checkpoint
    from taps_ray.spec.decoder import load_drafter

    head = load_drafter(tiny_target, None, seed=0)
    foreign = tmp_path / "model"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DrafterSaveError):
        head.save(foreign, tiny_target.fingerprint)
    assert json.loads((foreign / "config.json").read_text()) == {"architectures": ["LlamaForCausalLM"]}
    saved = head.save(tmp_path / "drafter", tiny_target.fingerprint)
    assert is_drafter_checkpoint(saved)
    head.save(saved, tiny_target.fingerprint)  # a drafter checkpoint is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "model"]


def test_a_command_refused_before_writing_leaves_no_folder(tmp_path):
    with pytest.raises(ValueError):
        with folder_lock(tmp_path / "new", "taps sweep"):
            raise ValueError("bad input")
    assert not (tmp_path / "new").exists()
    with folder_lock(tmp_path / "kept", "taps sweep"):
        (tmp_path / "kept" / "sweep.json").write_text("{}")
    assert (tmp_path / "kept" / "sweep.json").exists()
