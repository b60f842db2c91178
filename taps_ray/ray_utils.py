"""Starting or joining a Ray cluster with settings that keep a small machine fast and quiet."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_DEDUP_LOGS": "1",
    "RAY_TRAIN_V2_ENABLED": "1",
}


def set_ray_env() -> None:
    """Export the Ray environment defaults (values already set by the user win)."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)


def init_ray(address: str | None = None, num_cpus: int | None = None):
    """Join ``address`` (or ``$RAY_ADDRESS``) when given, else start an in-process local cluster.

    A local cluster gets ``num_cpus`` logical CPUs (default 4, so a 2-core laptop can run a
    target actor next to trainer workers), no dashboard and a 256 MiB object store.
    """
    set_ray_env()
    import ray

    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": {k: os.environ[k] for k in (*RAY_ENV, "TAPS_CACHE", "TAPS_DATA_DIR") if k in os.environ}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(
            num_cpus=num_cpus or int(os.environ.get("TAPS_RAY_CPUS", "4")),
            include_dashboard=False,
            object_store_memory=256 * 1024 * 1024,
            runtime_env=runtime_env,
            log_to_driver=True,
            configure_logging=True,
            logging_level=logging.WARNING,
        )
    log.info("ray cluster resources: %s", ray.cluster_resources())
    return ray


def quiet_ray_data() -> None:
    """Ray Data without per-operator progress bars or execution banners (the overall bar only on a TTY)."""
    import sys

    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.print_on_execution_start = False
    ctx.enable_operator_progress_bars = False
    ctx.enable_progress_bars = sys.stderr.isatty()
    logging.getLogger("ray.data").setLevel(logging.WARNING)
