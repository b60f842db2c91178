"""The suite's own scheduling (``tests/conftest.py``): pytest-xdist, as ``make test`` runs it, hands out the
:data:`~tests.conftest.LONGEST_FIRST` modules first and in that order."""

from __future__ import annotations

from types import SimpleNamespace

from xdist.scheduler import LoadFileScheduling

from tests.conftest import LONGEST_FIRST, REPO


class _Worker:
    """What xdist's scheduler calls on a worker: the test indices it is sent."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def test_every_longest_first_module_exists():
    assert [m for m in LONGEST_FIRST if not (REPO / "tests" / m).is_file()] == []


def test_xdist_hands_out_the_longest_modules_first_even_where_they_have_few_tests(pytestconfig):
    """Two workers, the suite's options: a module of one test listed first in LONGEST_FIRST goes out before a
    module of fifty (xdist's default, most tests first, would send it last)."""
    longest, second = LONGEST_FIRST[:2]
    collection = ([f"tests/{longest}::test_long"] + [f"tests/{second}::test_{i}" for i in range(3)]
                  + [f"tests/test_many.py::test_{i}" for i in range(50)])
    config = SimpleNamespace(option=pytestconfig.option, getvalue=lambda name: ["2*popen"])
    scheduler = LoadFileScheduling(config)
    workers = [_Worker("gw0"), _Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    assert workers[0].sent[0] == 0, "the longest module did not go out first"
    assert workers[1].sent[0] == 1, "the second longest did not go out second"
