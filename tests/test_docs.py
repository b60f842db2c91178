"""The README's layout names what the repository holds: every top-level file and folder, and every
module and subpackage of taps_ray (tracked files, as ``git ls-files`` lists them)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.splitlines()


def _layout() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Layout"):]
    return section.split("```")[1]


def test_readme_layout_names_every_top_level_entry_and_package_module():
    files = _tracked()
    layout = _layout()
    top = {p.split("/")[0] + ("/" if "/" in p else "") for p in files}
    package = {p.split("/")[1] + ("/" if p.count("/") > 1 else "") for p in files if p.startswith("taps_ray/")}
    missing = [f"{name}" for name in sorted(top - {".gitignore", ".ci/"})
               if not re.search(rf"^{re.escape(name)}(\s|$)", layout, re.M)]
    missing += [f"taps_ray/{name}" for name in sorted(package - {"__init__.py"})
                if not re.search(rf"^  {re.escape(name)}(\s|$)", layout, re.M)]
    assert not missing, f"README.md's layout does not name {missing}"
    assert re.search(r"^\.ci/run\s", layout, re.M)


def test_design_layout_names_every_module_of_the_package():
    """docs/DESIGN.md's layout (the design of record) names each module at least as often as modules of that
    name exist (``drafter.py`` is in models/ and serving/)."""
    text = (REPO / "docs" / "DESIGN.md").read_text()
    layout = text[text.index("## Layout"):].split("```")[1]
    modules = [p.rsplit("/", 1)[-1] for p in _tracked()
               if p.startswith("taps_ray/") and p.endswith(".py") and not p.endswith("__init__.py")]
    missing = sorted({name for name in modules
                      if len(re.findall(rf"(?<![\w/]){re.escape(name)}\b", layout)) < modules.count(name)})
    assert not missing, f"docs/DESIGN.md's layout does not name {missing}"


def _owners() -> dict[str, str]:
    """docs/DESIGN.md's list of modules tested outside a mirror file: ``module path -> test file``."""
    text = (REPO / "docs" / "DESIGN.md").read_text()
    section = text[text.index("Tests mirror the package"):].split("```")[1]
    pairs = re.findall(r"(\S+\.py)\s+(tests/\S+\.py)", section)
    return {module: test for module, test in pairs}


def test_every_module_has_its_mirror_test_file_or_an_owner_named_in_design():
    modules = [p.removeprefix("taps_ray/") for p in _tracked()
               if p.startswith("taps_ray/") and p.endswith(".py") and not p.endswith("__init__.py")]
    owners = _owners()

    def mirror(module: str) -> str:
        folder, _, name = module.rpartition("/")
        return f"tests/{folder + '/' if folder else ''}test_{name}"

    unowned = [m for m in modules if not (REPO / mirror(m)).is_file() and m not in owners]
    assert not unowned, f"no test file of their own and no owner in docs/DESIGN.md: {unowned}"
    stale = [m for m in owners if m not in modules or (REPO / mirror(m)).is_file()]
    assert not stale, f"docs/DESIGN.md names owners of modules that are gone or have their own test file: {stale}"
    missing = sorted({t for t in owners.values() if not (REPO / t).is_file()})
    assert not missing, f"docs/DESIGN.md names test files that do not exist: {missing}"
