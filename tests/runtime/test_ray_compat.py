"""Private Ray APIs only in taps_ray/runtime/ray_compat.py, and its check of the installed Ray version."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata

import pytest

from taps_ray.runtime import ray_compat
from taps_ray.runtime.ray_compat import ESCAPE_ENV, UntestedRayError, check_ray_version
from tests.conftest import REPO

PRIVATE = re.compile(r"\bray(?:\.\w+)*\.(?:_private|_internal|_raylet)\b")
"""A dotted path into a private Ray module: ray._private, ray.serve._private, ray.train.v2._internal, ray._raylet."""


def private_ray_uses(source: str) -> list[str]:
    """Private Ray module paths named in ``source``, and private methods of a ``*Trainer`` base that a
    class there overrides."""
    found = [m.group(0) for m in PRIVATE.finditer(source)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Trainer") for b in node.bases):
            found += [f"{node.name}.{f.name}" for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                      and f.name.startswith("_") and not f.name.endswith("__")]
    return found


def test_no_module_but_ray_compat_uses_private_ray_apis():
    uses = {str(path.relative_to(REPO)): found for path in sorted((REPO / "taps_ray").rglob("*.py"))
            if path.name != "ray_compat.py" and (found := private_ray_uses(path.read_text()))}
    assert not uses, f"private Ray APIs outside taps_ray/runtime/ray_compat.py: {uses}"


@pytest.mark.parametrize("source", [
    "import ray._private.worker as w\n",
    "from ray.serve._private.constants import SERVE_NAMESPACE\n",
    "def f():\n    from ray.train.v2._internal.execution import context\n",
    "from ray._raylet import PlacementGroupID\n",
    "class T(TorchTrainer):\n    def _create_default_callbacks(self):\n        return []\n",
])
def test_the_check_finds_each_kind_of_private_use(source):
    assert private_ray_uses(source)


def test_public_ray_apis_pass_the_check():
    assert not private_ray_uses("from ray import serve\nfrom ray.util.metrics import Counter\n"
                                "class T(TorchTrainer):\n    def __init__(self):\n        pass\n")


@pytest.mark.parametrize("version", ["2.60.0", "2.60.7"])
def test_a_tested_version_passes(version):
    assert check_ray_version(version, environ={}) == version


@pytest.mark.parametrize("version", ["2.59.9", "2.61.0", "3.0.0", "2.60.0rc1", "3.0.0.dev0", "nightly"])
def test_an_untested_version_fails_naming_the_range_and_the_escape(version):
    with pytest.raises(UntestedRayError) as err:
        check_ray_version(version, environ={})
    assert f"ray {version} is installed" in str(err.value) and ">=2.60.0,<2.61.0" in str(err.value)
    assert f"{ESCAPE_ENV}=1" in str(err.value)


def test_the_escape_hatch_warns_instead():
    with pytest.warns(RuntimeWarning, match="tested only on ray>=2.60.0,<2.61.0"):
        assert check_ray_version("2.61.0", environ={ESCAPE_ENV: "1"}) == "2.61.0"


def test_the_installed_and_the_pinned_ray_are_tested():
    assert ray_compat.RAY_VERSION == metadata.version("ray")
    pin = re.search(r'"ray\[[^\]]*\]==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert check_ray_version(pin, environ={}) == pin


@pytest.mark.parametrize("escape", [None, "1"])
def test_importing_it_under_an_untested_ray_fails_unless_escaped(escape):
    code = ("import importlib.metadata as m; m.version = lambda name: '2.99.0'\n"
            "import taps_ray.runtime.ray_compat\nprint('imported')")
    env = {"PATH": "", **({ESCAPE_ENV: escape} if escape else {})}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    if escape:
        assert run.returncode == 0 and "imported" in run.stdout and "RuntimeWarning" in run.stderr
    else:
        assert run.returncode != 0 and "UntestedRayError" in run.stderr and "ray 2.99.0 is installed" in run.stderr


@pytest.mark.slow
def test_the_trainer_override_replaces_rays_placement_group_cleaner_and_drops_an_unused_datasets_callback():
    from taps_ray.runtime.cluster import set_ray_env

    set_ray_env()  # Train V2
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    class Cleaner:
        pass

    trainer_cls = ray_compat.trainer_with_taps_default_callbacks(TorchTrainer, Cleaner, "DrafterTrainer")
    def callbacks(cls, **datasets) -> list[str]:
        trainer = cls(lambda: None, scaling_config=ScalingConfig(num_workers=1), datasets=datasets or None)
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    default = callbacks(TorchTrainer)
    assert trainer_cls.__name__ == "DrafterTrainer" and {"PlacementGroupCleanerCallback", "DatasetsCallback"} <= set(default)
    assert callbacks(trainer_cls) == [n for n in default if n not in ("PlacementGroupCleanerCallback", "DatasetsCallback")
                                      ] + ["Cleaner"]
    assert callbacks(trainer_cls, rows=lambda: None) == [n for n in default if n != "PlacementGroupCleanerCallback"
                                                        ] + ["Cleaner"]
