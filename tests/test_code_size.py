"""Size limits of the package's code, read with ``ast``: no module over 500 lines, no function or method
over 60 (issue 31's bounds, so that a module stays one concept and a function reads in a minute)."""

from __future__ import annotations

import ast
from pathlib import Path

import taps_ray

PACKAGE = Path(taps_ray.__file__).parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method of ``source`` longer than ``limit`` lines, decorators excluded."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_60_lines():
    long = {f"{p.relative_to(PACKAGE)}:{name}": n for p in _sources() for name, n in long_functions(p.read_text())}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_function_count_sees_a_long_method():
    body = "\n".join(f"        x{i} = {i}" for i in range(61))
    source = f"class A:\n    def short(self):\n        return 1\n\n    def long(self):\n{body}\n"
    assert long_functions(source) == [("long", 62)]
    assert long_functions(source, limit=62) == []
