"""The one place that reaches into Ray's private modules, fenced by a check of Ray's version.

Everything here leans on Ray internals that may change in any release: ``ray._private`` (the
printer of streamed worker output and its helpers), ``ray._raylet`` (placement group ids),
``ray.serve._private`` (the Serve controller's actor name) and ``ray.train.v2._internal`` (Train
controller callbacks, the placement-group cleaner, the per-report logger), plus the override of
the private ``TorchTrainer._create_default_callbacks``. No other module of ``taps_ray`` imports a
private Ray module (``tests/test_ray_compat.py`` greps for it).

Importing this module checks the installed Ray (its package metadata; Ray itself is not imported)
against :data:`TESTED_RAY`, the range these uses were tested on, and raises
:class:`UntestedRayError` outside it. ``TAPS_RAY_UNTESTED=1`` turns the error into a warning, at
your own risk. The private imports themselves happen lazily, when a function (or a module
attribute: :data:`ControllerCallback`, :data:`WorkerGroupCallback`) is first used.
"""

from __future__ import annotations

import os
import re
import warnings
from importlib import metadata

TESTED_RAY = ((2, 60, 0), (2, 61, 0))
"""Ray versions the private uses below were tested on: from the first (inclusive) to the second
(exclusive); ``pyproject.toml`` pins one inside it."""
ESCAPE_ENV = "TAPS_RAY_UNTESTED"
"""Set to 1 to run on a Ray outside :data:`TESTED_RAY` anyway (a warning instead of an error)."""


class UntestedRayError(ImportError):
    """The installed Ray is outside :data:`TESTED_RAY` (or missing)."""


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(x or 0) for x in match.groups()) if match else None


def check_ray_version(version: str | None = None, environ=os.environ) -> str:
    """Return the installed Ray version (or ``version``) when it lies in :data:`TESTED_RAY`; otherwise
    raise :class:`UntestedRayError` naming the tested range and :data:`ESCAPE_ENV`, or only warn when
    ``environ[ESCAPE_ENV]`` is 1. A pre-release or dev build of a tested release counts as untested."""
    if version is None:
        try:
            version = metadata.version("ray")
        except metadata.PackageNotFoundError:
            raise UntestedRayError("Ray is not installed: pip install -e . installs the version taps_ray pins") from None
    low, high = TESTED_RAY
    release = _release(version)
    plain = release is not None and re.fullmatch(r"\d+\.\d+(\.\d+)?", version) is not None
    if plain and low <= release < high:
        return version
    tested = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    message = (f"taps_ray uses private Ray APIs (taps_ray/runtime/ray_compat.py) tested only on ray{tested}, but ray "
               f"{version} is installed. Install the pinned version (pip install -e .), or set {ESCAPE_ENV}=1 "
               f"to run anyway at your own risk")
    if environ.get(ESCAPE_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return version
    raise UntestedRayError(message)


RAY_VERSION = check_ray_version()


def __getattr__(name: str):
    """Lazy aliases of Train V2's controller callback base classes (``ray.train.v2._internal``)."""
    if name in ("ControllerCallback", "WorkerGroupCallback"):
        from ray.train.v2._internal.execution import callback

        return getattr(callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- Ray core: the printer of streamed worker output (see taps_ray.runtime.cluster) ---

def worker_log_printer():
    """The function the driver calls with each batch of output streamed from Ray processes
    (``ray._private.worker.print_worker_logs``; None when this Ray has none)."""
    import ray._private.worker as ray_worker

    return getattr(ray_worker, "print_worker_logs", None)


def set_worker_log_printer(printer) -> None:
    """Make ``printer(data, print_file=None, ignore_prefix=False)`` Ray's printer of worker output."""
    import ray._private.worker as ray_worker

    ray_worker.print_worker_logs = printer


def filter_autoscaler_events(lines: list[str]) -> list[str]:
    """The autoscaler's event lines among ``lines``, as Ray's own printer keeps them."""
    import ray._private.worker as ray_worker

    return ray_worker.filter_autoscaler_events(lines)


def log_prefix_info_message() -> str:
    """The marker Ray puts before a worker's info message (what follows it is the message)."""
    from ray._private.ray_constants import LOG_PREFIX_INFO_MESSAGE

    return LOG_PREFIX_INFO_MESSAGE


def placement_group_from_hex(hex_id: str):
    """The :class:`ray.util.placement_group.PlacementGroup` of a hex id (``group.id.hex()``)."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id)))


# --- Ray Serve ---

def serve_controller():
    """The Serve controller's actor handle (blocking: call it off an event loop)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


SERVE_CONTROLLER_TIMEOUT_S = 30.0


def serve_http_host() -> str | None:
    """The address Serve's HTTP proxies bind (the Serve controller's ``get_http_config().host``); None when this
    process is not connected to Ray or no Serve controller runs. Blocking: call it off an event loop."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        controller = serve_controller()
    except ValueError:
        return None
    return ray.get(controller.get_http_config.remote(), timeout=SERVE_CONTROLLER_TIMEOUT_S).host


# --- Ray Train V2 ---

def train_report_logger_name() -> str:
    """The name of the logger that prints Ray Train's per-report INFO line (named after its module file)."""
    from ray.train.v2._internal.execution import context

    return context.__file__


def trainer_with_taps_default_callbacks(trainer_cls: type, cleaner_factory, name: str) -> type:
    """A subclass ``name`` of ``trainer_cls`` (e.g. ``TorchTrainer``) whose default controller callbacks
    have Ray's placement-group cleaner replaced by ``cleaner_factory()``, and Ray's datasets callback dropped
    when the trainer is given no Ray Datasets (it would start a ``DatasetManager`` actor, a process, for
    none). Overrides the private ``_create_default_callbacks``."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class Trainer(trainer_cls):
        def _create_default_callbacks(self):
            dropped = (PlacementGroupCleanerCallback, *(() if self.datasets else (DatasetsCallback,)))
            kept = [c for c in super()._create_default_callbacks() if not isinstance(c, dropped)]
            return [*kept, cleaner_factory()]

    Trainer.__name__ = Trainer.__qualname__ = name
    return Trainer
