"""The placement-group reaper frees a dead controller's reservation without the state API."""

from __future__ import annotations

import time

import ray

from taps_ray.runtime.placement import RECORD, PlacementGroupReaper, remove_recorded


@ray.remote(num_cpus=0)
class Controller:
    """Stands in for a Train controller: reserves a group scoped to the job, not to itself."""

    def reserve(self):
        group = ray.util.placement_group([{"CPU": 0.01}])  # a sliver: other tests' actors on the shared cluster may hold CPUs
        ray.get(group.ready(), timeout=60)
        return group


def _state(group) -> str:
    return ray.util.placement_group_table(group)["state"]


def test_group_of_a_killed_controller_is_removed_and_a_live_one_is_kept(ray_session):
    reapers = []
    for _ in range(2):
        controller = Controller.remote()
        group = ray.get(controller.reserve.remote(), timeout=90)
        reaper = ray.remote(num_cpus=0)(PlacementGroupReaper).options(lifetime="detached").remote(controller, 0.2)
        ray.get(reaper.register.remote(group))
        reaper.watch.remote()
        reapers.append((controller, group, reaper))
    (dead, dead_group, _), (alive, alive_group, alive_reaper) = reapers
    ray.kill(dead)
    deadline = time.time() + 30
    while _state(dead_group) != "REMOVED":
        assert time.time() < deadline, "the dead controller's placement group is still reserved"
        time.sleep(0.2)
    assert _state(alive_group) == "CREATED"
    ray.get(alive_reaper.stop.remote())
    ray.kill(alive)
    deadline = time.time() + 30
    while True:  # the stopped reaper exits at its next ping, whatever it finds
        try:
            ray.get(alive_reaper.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        assert time.time() < deadline, "a stopped reaper never exited"
        time.sleep(0.1)
    assert _state(alive_group) == "CREATED", "a stopped reaper leaves removal to the controller"
    ray.util.remove_placement_group(alive_group)


def test_remove_recorded_frees_the_recorded_groups_under_a_folder_only(ray_session, tmp_path):
    controller = Controller.remote()
    groups = {name: ray.get(controller.reserve.remote(), timeout=90) for name in ("trial", "done", "elsewhere")}
    ray.util.remove_placement_group(groups["done"])
    for folder, names in (("sweep/trials/t1/ray/v", ["trial", "done"]), ("other/ray/v", ["elsewhere"])):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / RECORD).write_text("".join(groups[n].id.hex() + "\n" for n in names))
    assert remove_recorded(tmp_path / "sweep") == 1
    assert _state(groups["trial"]) == "REMOVED" and _state(groups["done"]) == "REMOVED"
    assert _state(groups["elsewhere"]) == "CREATED", "runs stored elsewhere are left alone"
    assert remove_recorded(tmp_path / "sweep") == 0
    ray.util.remove_placement_group(groups["elsewhere"])
    ray.kill(controller)
