"""Starting or joining a Ray cluster with settings that keep a small machine fast and quiet.

The console. A command that runs Ray (``taps demo``, ``prepare``, ``train``, ``eval``, ``sweep``)
calls :func:`route_ray_logs` with a file under its run folder (:func:`ray_log_path`:
``<run_dir>/logs/ray.log``) before Ray starts. From then on, in this process:

- the Python loggers of Ray (:data:`RAY_LOGGERS`: ``ray``, ``ray.data``, ``ray.tune``, ``ray.train``,
  ``ray.serve``, ``ray.air``) and Python warnings write to that file only (their console handlers
  are removed, they do not propagate): "Cluster resources are not enough ... may hang forever",
  Ray Data's "Found N issues", Tune and Train status lines, deprecation notes;
- output streamed from Ray workers is split: what a worker prints on stdout (our own progress
  lines, e.g. the target actors' ``math: features: 40/40 rows``) is printed on the console without
  Ray's ``(pid=...)`` prefix; what it writes on stderr (Ray's and libraries' log records in that
  process), notes of the raylet (actor restarts, dead workers) and of the autoscaler go to the file
  only, with their prefix;
- Ray Data draws no progress bars (the target actors print their own progress);
- lines that native code (Ray's C++ core worker, gRPC) writes straight to this process's stderr
  in its log format (``[2026-01-01 12:00:00,000 E 123 123] core_worker.cc:...``) go to the file:
  file descriptor 2 is read through a pipe and every other byte is passed on to the console
  unchanged, so Python's own stderr (our log lines, tracebacks) is not touched.

Everything goes to the file as well, so the file is the complete record of a run. Our own
messages (``print`` and the ``taps`` / ``taps_ray`` loggers) stay on the console.
:func:`stop_routing_ray_logs` undoes it all (tests).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

from taps_ray.runtime import ray_compat

log = logging.getLogger(__name__)

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_DEDUP_LOGS": "1",
    "RAY_TRAIN_V2_ENABLED": "1",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's switch for its preemption watcher (read by the driver, passed on to the Train controller)."""
RAY_LOGGERS = ("ray", "ray.data", "ray.tune", "ray.train", "ray.serve", "ray.air", "py.warnings")
"""Loggers whose records go to the Ray log file instead of the console (``py.warnings``: Python warnings)."""
WORKER_OUTPUT_LOGGER = "ray.worker_output"
"""The logger that writes lines streamed from Ray workers into the Ray log file."""
NATIVE_LOGGER = "ray.native_stderr"
"""The logger that writes native log lines from this process's stderr into the Ray log file."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
NATIVE_LOG_LINE = re.compile(
    rb"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z] \d+ \d+\] "  # Ray's C++ logger
    rb"|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] "  # glog / absl (gRPC)
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called)")
"""A line native code logs on stderr: it goes to the Ray log file, not the console."""


def set_ray_env() -> None:
    """Export the Ray environment defaults (values already set by the user win). Serve's HTTP proxy gets 30 s
    (Ray's default: 5 s) to answer its readiness check: on two busy cores its start takes longer, and three
    missed checks made Serve replace it and ``serve.start`` fail. Ray's log monitor looks for new workers' log
    files every 0.5 s instead of every 0.1 s (idle, with 124 files: 0.8% of a core instead of 1.5%). Ray's
    auth mode is not one of them: a local cluster keeps Ray's own default (token authentication since Ray
    2.59; ``RAY_AUTH_MODE`` set by the user wins), so the control plane of a cluster ``taps`` starts is never
    open by our choice."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)


def ray_log_path(run_dir: str | Path) -> Path:
    """Where a command that uses run folder ``run_dir`` writes Ray's own messages."""
    return Path(run_dir) / "logs" / "ray.log"


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        stat = os.fstat(fd)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


class _NativeStderr:
    """File descriptor 2 through a pipe: :data:`NATIVE_LOG_LINE` lines to the Ray log file, the rest
    to the original stderr as it arrives (partial lines too, so progress bars keep drawing)."""

    def __init__(self):
        sys.stderr.flush()
        self.console = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        self.pipe = _identity(write)
        os.close(write)
        self.read = read
        self.writer = logging.getLogger(NATIVE_LOGGER)
        self.thread = threading.Thread(target=self._pump, name="taps-native-stderr", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                data = os.read(self.read, 1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                self._route(line + b"\n")
            if pending and not pending.startswith(b"[") and not NATIVE_LOG_LINE.match(pending):
                self._route(pending)  # a partial line that is not a native log line: show it now
                pending = b""
        if pending:
            self._route(pending)
        os.close(self.read)

    def _route(self, data: bytes) -> None:
        try:
            if NATIVE_LOG_LINE.match(data):
                self.writer.info("%s", data.decode(errors="replace").rstrip("\n"))
                return
        except Exception:  # noqa: BLE001  (never stop pumping: a full pipe would block every stderr write)
            pass
        os.write(self.console, data)

    def stop(self) -> None:
        """Give fd 2 back to the original stderr and pass on what is still in the pipe."""
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        if _identity(2) == self.pipe:  # else someone has pointed fd 2 elsewhere since (pytest's capture does)
            os.dup2(self.console, 2)  # closes the pipe's last write end: the pump reads to the end and exits
        self.thread.join(timeout=2)
        if not self.thread.is_alive():  # else a process still holds the pipe: the pump may yet write here
            os.close(self.console)


class _Routing:
    """What :func:`route_ray_logs` changed, to undo it."""

    def __init__(self, handler: logging.FileHandler):
        self.handler = handler
        self.saved: dict[str, tuple[list[logging.Handler], bool, int]] = {}
        self.native: _NativeStderr | None = None


_routing: _Routing | None = None
_ray_print_worker_logs = None
"""Ray's own ``print_worker_logs``, kept while :func:`_print_worker_logs` replaces it."""


def ray_log() -> Path | None:
    """The file Ray's messages go to, or None when they go to the console (no :func:`route_ray_logs`)."""
    return Path(_routing.handler.baseFilename) if _routing else None


def route_ray_logs(path: str | Path) -> Path:
    """Send Ray's own log records and its workers' stderr to ``path`` (appended), not to the console.

    See the module docstring for what goes where. Idempotent; a second call with another path
    moves the routing there. Returns the file's absolute path.
    """
    global _routing
    path = Path(path).resolve()
    if _routing is not None and Path(_routing.handler.baseFilename) != path:
        stop_routing_ray_logs()
    if _routing is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.setLevel(logging.INFO)
        command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python"
        handler.stream.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {command} (pid {os.getpid()}) ----\n")
        handler.flush()
        _routing = _Routing(handler)
        logging.captureWarnings(True)
        _at_exit()
        native = logging.getLogger(NATIVE_LOGGER)
        _routing.saved[NATIVE_LOGGER] = ([], native.propagate, native.level)
        native.addHandler(handler)
        native.propagate = False
        native.setLevel(logging.INFO)
        _routing.native = _NativeStderr()
    _route_loggers()
    _route_worker_output()
    return path


_exit_handler_registered = False


def _at_exit() -> None:
    """Stop the routing at exit, after Ray's own exit handler (registered when ``ray`` is first imported,
    so this must run before that import: exit handlers run last registered first)."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(stop_routing_ray_logs)
        _exit_handler_registered = True


def stop_routing_ray_logs() -> None:
    """Undo :func:`route_ray_logs`: the loggers get their handlers back, worker output is printed as Ray does."""
    global _routing
    if _routing is None:
        return
    routing, _routing = _routing, None
    if routing.native is not None:
        routing.native.stop()
    for name, (handlers, propagate, level) in routing.saved.items():
        logger = logging.getLogger(name)
        logger.removeHandler(routing.handler)
        for handler in handlers:
            logger.addHandler(handler)
        logger.propagate, logger.level = propagate, level
    logging.captureWarnings(False)
    if _ray_print_worker_logs is not None:
        ray_compat.set_worker_log_printer(_ray_print_worker_logs)
    routing.handler.close()


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def _route_loggers() -> None:
    """Point :data:`RAY_LOGGERS` at the file handler (again: importing ``ray.data`` or ``ray.init`` may
    have configured them since)."""
    import ray  # noqa: F401  (its import gives the "ray" logger a console handler; replace it after)

    detached = [name for name, logger in logging.Logger.manager.loggerDict.items()
                if name.startswith("ray.") and isinstance(logger, logging.Logger) and not logger.propagate
                and name not in RAY_LOGGERS]  # e.g. Train v2's own loggers: they would bypass the file
    for name in (*RAY_LOGGERS, *detached, WORKER_OUTPUT_LOGGER, NATIVE_LOGGER):
        logger = logging.getLogger(name)
        if name not in _routing.saved:
            _routing.saved[name] = ([h for h in logger.handlers if _is_console(h)], logger.propagate, logger.level)
        for handler in [h for h in logger.handlers if _is_console(h)]:
            logger.removeHandler(handler)
        if _routing.handler not in logger.handlers:
            logger.addHandler(_routing.handler)
        logger.propagate = False
        if name in ("ray", "ray.data", WORKER_OUTPUT_LOGGER, NATIVE_LOGGER) and logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)


def _route_worker_output() -> None:
    """Replace Ray's printer of worker output (:func:`taps_ray.runtime.ray_compat.worker_log_printer`, used for
    the workers' stdout/stderr and the raylet's error notes) with :func:`_print_worker_logs`."""
    global _ray_print_worker_logs
    current = ray_compat.worker_log_printer()
    if current is None or current is _print_worker_logs:
        return
    _ray_print_worker_logs = current
    ray_compat.set_worker_log_printer(_print_worker_logs)


def _print_worker_logs(data: dict, print_file=None, ignore_prefix: bool = False) -> None:
    """One batch of lines from a Ray process: all into the Ray log; a worker's stdout also on the console."""
    if _routing is None:  # a batch in flight while the routing was stopped
        return _ray_print_worker_logs(data, print_file, ignore_prefix)
    from ray.experimental.tqdm_ray import RAY_TQDM_MAGIC

    info_prefix = ray_compat.log_prefix_info_message()

    pid = data.get("pid")
    name = data.get("actor_name") or data.get("task_name") or ""
    prefix = f"({name + ' ' if name else ''}pid={pid}{', stderr' if data.get('is_err') else ''})"
    to_console = not data.get("is_err") and pid not in ("raylet", "autoscaler", None)
    writer = logging.getLogger(WORKER_OUTPUT_LOGGER)
    lines = data.get("lines", [])
    if pid == "autoscaler":  # its events only, as Ray prints them (not every status report)
        lines = ray_compat.filter_autoscaler_events(lines)
    shown = []
    for line in lines:
        if RAY_TQDM_MAGIC in line:
            continue
        if info_prefix in line:
            line = line.split(info_prefix, 1)[1]
        writer.info("%s %s", prefix, line)
        if to_console:
            shown.append(line)
    if shown:
        print("\n".join(shown), file=print_file or sys.stdout, flush=True)


def init_ray(address: str | None = None, num_cpus: int | None = None):
    """Join ``address`` (or ``$RAY_ADDRESS``) when given, else start a new in-process local cluster (never
    one that ``ray start`` or a test cluster left its address for in Ray's temp folder).

    A local cluster gets ``num_cpus`` logical CPUs (default 4, so a 2-core laptop can run a
    target actor next to trainer workers), no dashboard and a 256 MiB object store, and Ray Train runs
    without its preemption watcher (an actor per training run that polls for nodes being drained: this
    process's machine is the only node), unless ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER`` is set. With
    :func:`route_ray_logs` active, Ray's messages (INFO and up) go to its file; otherwise Ray logs
    warnings and up to the console.
    """
    set_ray_env()
    import ray

    if ray.is_initialized():
        return ray
    routed = _routing is not None
    if routed:
        import ray.data  # noqa: F401  (its import configures the "ray.data" logger: do it before routing)

        _route_loggers()
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": {k: os.environ[k] for k in (*RAY_ENV, "TAPS_CACHE", "TAPS_DATA_DIR", ray_compat.ESCAPE_ENV) if k in os.environ}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True, configure_logging=not routed)
    else:
        os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
        ray.init(
            address="local",  # a new cluster even when `ray start` left its address in Ray's temp folder
            num_cpus=num_cpus or int(os.environ.get("TAPS_RAY_CPUS", "4")),
            include_dashboard=False,
            object_store_memory=256 * 1024 * 1024,
            runtime_env=runtime_env,
            log_to_driver=True,
            configure_logging=not routed,
            logging_level=logging.WARNING,
        )
    if routed:
        _route_loggers()
        _route_worker_output()
    log.info("ray cluster resources: %s", ray.cluster_resources())
    return ray


def quiet_ray_data() -> None:
    """Ray Data without per-operator progress bars or execution banners; the overall bar only on a TTY
    and never while :func:`route_ray_logs` is active (the target actors print their own progress)."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.print_on_execution_start = False
    ctx.enable_operator_progress_bars = False
    ctx.enable_progress_bars = sys.stderr.isatty() and _routing is None
    if _routing is None:
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    else:
        _route_loggers()
