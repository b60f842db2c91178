"""The placement-group reaper frees a dead controller's reservation without the state API."""

from __future__ import annotations

import time

import ray

from taps_ray.train.placement import NAMESPACE, PlacementGroupReaper, reap_under, reaper_name


@ray.remote(num_cpus=0)
class Controller:
    """Stands in for a Train controller: reserves a group scoped to the job, not to itself."""

    def reserve(self):
        group = ray.util.placement_group([{"CPU": 1.0}])
        ray.get(group.ready())
        return group


def _state(group) -> str:
    return ray.util.placement_group_table(group)["state"]


def test_group_of_a_killed_controller_is_removed_and_a_live_one_is_kept(ray_session):
    reapers = []
    for _ in range(2):
        controller = Controller.remote()
        group = ray.get(controller.reserve.remote())
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
    time.sleep(1.0)
    assert _state(alive_group) == "CREATED", "a stopped reaper leaves removal to the controller"
    ray.util.remove_placement_group(alive_group)


def test_reap_under_frees_the_groups_of_runs_stored_in_a_folder_even_with_live_controllers(ray_session):
    made = {}
    for folder in ("/sweep/a/trials/t1/ray", "/other/ray"):
        controller = Controller.remote()
        group = ray.get(controller.reserve.remote())
        reaper = ray.remote(num_cpus=0)(PlacementGroupReaper).options(
            lifetime="detached", name=reaper_name(folder, "run0"), namespace=NAMESPACE).remote(controller, 0.2)
        ray.get(reaper.register.remote(group))
        reaper.watch.remote()
        made[folder] = (controller, group, reaper)
    assert reap_under("/sweep/a") == 1
    assert _state(made["/sweep/a/trials/t1/ray"][1]) == "REMOVED"
    assert _state(made["/other/ray"][1]) == "CREATED", "runs stored elsewhere are left alone"
    _, group, reaper = made["/other/ray"]
    ray.get(reaper.stop.remote())
    ray.util.remove_placement_group(group)
    for controller, _, _ in made.values():
        ray.kill(controller)
