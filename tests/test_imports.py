"""The import graph of taps_ray, read statically with ``ast``: no module cycle, no package cycle (counting
every import, function-local ones included), and no Ray in taps_ray/spec.

Edges: every ``import`` / ``from ... import`` of a taps_ray module at module level, including those
under a module-level ``if`` (``TYPE_CHECKING``) or ``try``; ``from pkg import name`` points at the
submodule ``pkg.name`` when there is one, else at ``pkg``. Imports inside a function or method are
not edges: they run when called, after every module has finished importing, so they cannot leave a
module half-initialised, and the package uses them only to keep heavy imports (torch, Ray, model
code) off light paths. Packages (``taps_ray.serving``, ``taps_ray.train``, ...; a top-level module is its
own unit) are layers, so their graph counts every import, function-local ones included: a package that
needs another at call time depends on it as much as one that imports it at load time. The Ray check reads
every import in taps_ray/spec, function-level included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import taps_ray

PACKAGE = Path(taps_ray.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["taps_ray", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run at import: the body, and the bodies of module-level if / try blocks."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If | ast.Try):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def _imported(node: ast.stmt, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The taps_ray modules an import statement imports (``from pkg import name``: ``pkg.name`` when it
    is a module, else ``pkg``)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules.keys()
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
    return submodules or {base} & modules.keys()


def import_graph() -> dict[str, set[str]]:
    """Module -> the taps_ray modules it imports at module level."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, set())
        for node in _module_level(ast.parse(path.read_text(), str(path))):
            edges |= _imported(node, module, path.name == "__init__.py", modules) - {module}
    return graph


def unit(module: str) -> str:
    """The package a module belongs to (``taps_ray.serving.verifier`` -> ``taps_ray.serving``); a top-level
    module is its own unit."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    """Package -> the other packages any of its modules imports anywhere (function-local imports included)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(unit(module), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= {unit(m) for m in _imported(node, module, path.name == "__init__.py", modules)}
        edges.discard(unit(module))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, .., a]`` of ``graph``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_module_level_imports_form_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_packages_form_no_cycle_counting_function_local_imports():
    graph = package_graph()
    assert "taps_ray.spec" in graph["taps_ray.serving"] and "taps_ray.config" in graph["taps_ray.models"]
    cycle = find_cycle(graph)
    assert cycle is None, "package cycle (function-local imports count): " + " -> ".join(cycle)


def test_the_cycle_finder_names_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "taps_ray.spec.tree" in graph["taps_ray.spec.decoder"]
    assert "taps_ray.spec.protocol" in graph["taps_ray.spec.compose"]


def test_spec_does_not_import_ray():
    found = []
    for module, path in _modules().items():
        if not module.startswith("taps_ray.spec"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{module} line {node.lineno}: {n}" for n in names if n.split(".")[0] == "ray"]
    assert not found, "taps_ray/spec imports Ray: " + "; ".join(found)
