"""Placement groups of a Ray Train run that outlive its controller are removed, with or without a dashboard.

A Train V2 worker group reserves its resources in a placement group scoped to the job, not to the
controller actor that created it. When the controller dies without shutting down (a Tune trial
stopped by ASHA or failed kills its trial actor, which owns the controller), the group stays
reserved until the job ends. Ray's own cleaner asks the state API, served by the dashboard,
whether the controller lives; with ``include_dashboard=False`` (the local default here) it can
never tell and the reservation leaks, starving the next trials. Every trainer here uses the
reaper instead (a worker process cannot tell reliably whether the cluster has a dashboard).
:class:`PlacementGroupReaper` is a detached actor that pings the controller and removes its groups
once it is gone; :class:`ReaperCallback` starts one per run, registers each worker group with it and
records the group's id in the run's folder. A controller whose abort is cut short can leave its
group behind while the reaper still sees it alive, so whoever knows the runs are over (a sweep)
calls :func:`remove_recorded` on their folder.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import ray

from taps_ray.runtime.ray_compat import ControllerCallback, WorkerGroupCallback, placement_group_from_hex

log = logging.getLogger(__name__)
RECORD = "placement_groups.txt"
"""One line per worker group (attempt) of a run: its placement group id, in ``<storage_path>/<run name>/``."""


class PlacementGroupReaper:
    """Watches one controller (an actor handle); when a ping reports it dead, removes every
    registered placement group that is still reserved and exits."""

    def __init__(self, controller, interval_s: float = 1.0):
        self.controller, self.interval_s = controller, interval_s
        self.groups: list = []
        self.stopped = False

    def register(self, group) -> None:
        self.groups.append(group)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.stopped:
                break
            try:
                await self.controller.__ray_ready__.remote()
            except ray.exceptions.RayActorError:
                if not self.stopped:
                    self._remove_groups()
                break
        ray.actor.exit_actor()

    def stop(self) -> None:
        """The controller shuts down normally and removes its groups itself: exit without removing."""
        self.stopped = True

    def _remove_groups(self) -> None:
        for group in self.groups:
            remove_if_reserved(group, "its Ray Train controller is gone")


class ReaperCallback(ControllerCallback, WorkerGroupCallback):
    """Train controller callback: one :class:`PlacementGroupReaper` per run, stopped when the run
    shuts down normally (the controller then removes its groups itself). An aborted run (a Tune
    trial stopped by its scheduler) keeps its reaper: the abort can be cut short when the trial
    actor, which owns the controller, exits. Each worker group's id is appended to the run's
    :data:`RECORD` file as soon as the group exists."""

    def __init__(self):
        self.reaper = None
        self.controller = None
        self.record: Path | None = None

    def after_controller_start(self, train_run_context) -> None:
        controller = ray.get_runtime_context().current_actor
        config = train_run_context.run_config
        if "://" not in str(config.storage_path):
            self.record = Path(config.storage_path) / config.name / RECORD
        self.controller = controller
        self._start_reaper()

    def _start_reaper(self) -> None:
        """A reaper on the controller's own node (a reaper on another node would die with that node and
        fail every later worker-group start of the run on a multi-node cluster)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.reaper = ray.remote(num_cpus=0)(PlacementGroupReaper).options(
            lifetime="detached", scheduling_strategy=here).remote(self.controller)
        self.reaper.watch.remote()

    def after_worker_group_start(self, worker_group) -> None:
        group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        if self.record is not None:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            with self.record.open("a") as f:
                f.write(group.id.hex() + "\n")
        if self.reaper is not None:
            try:
                ray.get(self.reaper.register.remote(group))
            except ray.exceptions.RayActorError:  # its node is gone: a new reaper takes over
                self._start_reaper()
                ray.get(self.reaper.register.remote(group))

    async def before_controller_shutdown(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.reaper is not None:
            try:
                ray.get(self.reaper.stop.remote(), timeout=10)
            except (ray.exceptions.RayError, TimeoutError) as err:
                log.warning("placement-group reaper did not stop cleanly: %s", err)
            self.reaper = None


def remove_recorded(folder: Path) -> int:
    """Remove the still reserved placement groups whose ids the runs stored under ``folder`` recorded
    (their :data:`RECORD` files); returns how many. Call it only once those runs are over."""
    removed = 0
    for path in Path(folder).rglob(RECORD):
        for line in path.read_text().split():
            group = placement_group_from_hex(line)
            removed += remove_if_reserved(group, f"left by the Train run in {path.parent}")
    return removed


def remove_if_reserved(group, why: str) -> bool:
    """Remove ``group`` unless it is already gone (logging ``why``); True when it was removed."""
    if ray.util.placement_group_table(group).get("state") in (None, "REMOVED"):
        return False
    log.warning("removing placement group %s: %s", group.id.hex(), why)
    ray.util.remove_placement_group(group)
    return True
