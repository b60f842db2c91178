"""Ray's own messages go to the run's log file, ours stay on the console (no Ray cluster needed)."""

from __future__ import annotations

import logging
import os

import pytest

from taps_ray.runtime import cluster

STARVED = "Cluster resources are not enough to run any task from MapBatches. The job may hang forever"


@pytest.fixture
def ray_log(tmp_path):
    path = cluster.route_ray_logs(cluster.ray_log_path(tmp_path / "runs" / "x"))
    yield path
    cluster.stop_routing_ray_logs()


def test_ray_log_path_is_under_the_run_folder(tmp_path):
    assert cluster.ray_log_path(tmp_path / "runs" / "demo") == tmp_path / "runs" / "demo" / "logs" / "ray.log"


def test_a_ray_warning_lands_in_the_file_not_on_stderr(capsys, ray_log, monkeypatch):
    import ray.data  # noqa: F401  (its import gives "ray.data" a console handler; init_ray routes again after it)

    for name in ("ray.data._internal.execution.resource_manager", "ray.tune", "ray.train.v2"):
        logger = logging.getLogger(name)  # earlier Tune/Train runs in this process may have changed these
        monkeypatch.setattr(logger, "level", logging.NOTSET)
        monkeypatch.setattr(logger, "disabled", False)
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "handlers", [])
    for name in ("ray.data", "ray.tune", "ray.train"):  # Train v2 runs raise "ray.train" to ERROR, for one
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
        monkeypatch.setattr(logging.getLogger(name), "disabled", False)
    cluster.route_ray_logs(ray_log)

    assert cluster.route_ray_logs(ray_log) == ray_log and cluster.ray_log() == ray_log and ray_log.is_file()
    for name in ("ray.data._internal.execution.resource_manager", "ray.tune", "ray.train.v2", "ray"):
        logging.getLogger(name).warning("%s (%s)", STARVED, name)
    logging.getLogger("py.warnings").warning("a deprecation note from a library")  # where warnings.warn goes
    logging.getLogger("taps_ray.data.features").warning("our own warning")
    out, err = capsys.readouterr()
    assert "may hang forever" not in out + err and "deprecation note" not in out + err
    text = ray_log.read_text()
    for name in ("ray.data._internal.execution.resource_manager", "ray.tune", "ray.train.v2", "ray"):
        assert f"WARNING {name}: {STARVED} ({name})" in text
    assert "a deprecation note from a library" in text and "our own warning" not in text


def test_worker_output_stdout_on_the_console_the_rest_in_the_file(capsys, ray_log):
    import ray._private.worker as ray_worker

    print_worker_logs = ray_worker.print_worker_logs  # what Ray calls for streamed worker output
    print_worker_logs({"pid": 41, "actor_name": "MapWorker(MapBatches(FeatureActor))", "is_err": False,
                       "lines": ["math: features: 40/40 rows, 9000 tokens, 300 tokens/s"]}, None)
    print_worker_logs({"pid": 42, "actor_name": "TrainController", "is_err": True,
                       "lines": ["[State Transition] INITIALIZING -> SCHEDULING."]}, None)
    print_worker_logs({"pid": "raylet", "is_err": False,
                       "lines": ["A worker died or was killed while executing a task by an unexpected system error"]},
                      None)
    out, err = capsys.readouterr()
    assert out == "math: features: 40/40 rows, 9000 tokens, 300 tokens/s\n" and err == ""
    text = ray_log.read_text()
    assert "(MapWorker(MapBatches(FeatureActor)) pid=41) math: features: 40/40 rows" in text
    assert "(TrainController pid=42, stderr) [State Transition] INITIALIZING -> SCHEDULING." in text
    assert "(pid=raylet) A worker died or was killed" in text


def test_a_library_logger_that_does_not_propagate_is_routed_too(ray_log, monkeypatch):
    detached = logging.getLogger("ray.train.v2._internal.example")
    monkeypatch.setattr(detached, "level", logging.INFO)  # not whatever earlier runs left on its ancestors
    monkeypatch.setattr(detached, "disabled", False)
    monkeypatch.setattr(detached, "propagate", False)
    monkeypatch.setattr(detached, "handlers", [logging.StreamHandler()])
    cluster.route_ray_logs(ray_log.parent / "other.log")
    detached.warning("detached warning")
    assert "detached warning" in (ray_log.parent / "other.log").read_text()
    assert not [h for h in detached.handlers if cluster._is_console(h)]


def test_stopping_restores_the_console(tmp_path, monkeypatch):
    tune = logging.getLogger("ray.tune")  # earlier Tune runs in this process may have raised its level
    monkeypatch.setattr(tune, "level", logging.NOTSET)
    monkeypatch.setattr(tune, "disabled", False)
    import ray._private.worker as ray_worker

    ray_print = ray_worker.print_worker_logs
    console = [h for h in logging.getLogger("ray").handlers if isinstance(h, logging.StreamHandler)]
    path = cluster.route_ray_logs(tmp_path / "a" / "ray.log")
    assert cluster.route_ray_logs(tmp_path / "a" / "ray.log") == path  # idempotent
    assert not [h for h in logging.getLogger("ray").handlers if cluster._is_console(h)]
    assert any(getattr(h, "baseFilename", None) == str(path) for h in logging.getLogger("ray").handlers)
    moved = cluster.route_ray_logs(tmp_path / "b" / "ray.log")
    logging.getLogger("ray.tune").warning("after the move")
    assert "after the move" in moved.read_text() and "after the move" not in path.read_text()
    cluster.stop_routing_ray_logs()
    assert cluster.ray_log() is None and ray_worker.print_worker_logs is ray_print
    assert [h for h in logging.getLogger("ray").handlers if isinstance(h, logging.StreamHandler)] == console
    assert logging.getLogger("ray").propagate is False and logging.getLogger("ray.tune").propagate is True
    import io

    for handler in console:  # Ray's console handler writes where it did before (its own stream, e.g. stderr)
        stream = io.StringIO()
        previous, handler.stream = handler.stream, stream
        try:
            logging.getLogger("ray.tune").warning("back on the console")
        finally:
            handler.stream = previous
        assert "back on the console" in stream.getvalue()


def test_native_log_lines_on_stderr_go_to_the_file(capfd, tmp_path):
    native = (b"[2026-11-30 14:17:08,465 E 4553 4553] core_worker.cc:2465: Actor with class name: 'MapWorker' "
              b"has constructor arguments in the object store and max_restarts > 0.\n")
    path = cluster.route_ray_logs(tmp_path / "ray.log")
    try:
        os.write(2, native)  # what Ray's C++ core worker does in this process
        os.write(2, b"12:00:01 INFO taps_ray.data.sources: dataset 'math': using alternative 0\n")
        os.write(2, b"progress 50%\r")  # a partial line is passed on as it comes
    finally:
        cluster.stop_routing_ray_logs()
    out, err = capfd.readouterr()
    assert err == "12:00:01 INFO taps_ray.data.sources: dataset 'math': using alternative 0\nprogress 50%\r"
    assert "core_worker.cc:2465: Actor with class name: 'MapWorker'" in path.read_text()
    os.write(2, native)
    assert capfd.readouterr().err == native.decode()  # routing stopped: stderr is stderr again


@pytest.mark.parametrize("given, env, expected", [(None, None, "local"), (None, "10.0.0.1:6379", "10.0.0.1:6379"),
                                                  ("auto", None, "auto")])
def test_init_ray_starts_its_own_cluster_unless_told_to_join_one(monkeypatch, given, env, expected):
    """Without an address ``ray.init`` would join the cluster whose address ``ray start`` left in Ray's temp
    folder (and then refuse ``num_cpus``); init_ray asks for a new local one instead, whose Train runs need no
    preemption watcher."""
    import ray

    calls = []
    monkeypatch.setenv(cluster.PREEMPTION_WATCHER_ENV, "")  # restored (to unset, if it was) after the test
    monkeypatch.delenv(cluster.PREEMPTION_WATCHER_ENV)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    cluster.init_ray(given)
    assert len(calls) == 1 and calls[0]["address"] == expected
    assert ("num_cpus" in calls[0]) == (expected == "local")
    assert os.environ.get(cluster.PREEMPTION_WATCHER_ENV) == ("0" if expected == "local" else None)


def test_set_ray_env_leaves_the_auth_mode_to_ray(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    cluster.set_ray_env()
    assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_MODE" not in cluster.RAY_ENV
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # an operator's explicit choice still wins
    cluster.set_ray_env()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


@pytest.mark.slow
def test_a_local_cluster_taps_starts_keeps_rays_token_authentication(tmp_path):
    """Outside the tests' own clusters nothing turns Ray's auth off: ``init_ray`` in a process without
    RAY_AUTH_MODE starts a cluster whose workers run with token authentication, its token in Ray's default
    place under the user's home. Its workers (Serve's controller among them) see the proxy readiness
    timeout of :data:`~taps_ray.runtime.cluster.RAY_ENV`."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env["HOME"] = str(tmp_path)
    code = ("import os\nfrom taps_ray.runtime.cluster import init_ray\nray = init_ray(num_cpus=1)\n"
            "print('worker-auth', ray.get(ray.remote(lambda: os.environ.get('RAY_AUTH_MODE')).remote()))\n"
            "from ray.serve._private import constants\n"
            "print('proxy-ready', ray.get(ray.remote(lambda: constants.PROXY_READY_CHECK_TIMEOUT_S).remote()))\n"
            "ray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "worker-auth token" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "proxy-ready 30.0" in done.stdout, done.stdout
    assert (tmp_path / ".ray" / "auth_token").stat().st_size > 0
