"""The shape of the package: imports flow one way, and no module grows past a page budget.

Every import counts, including those inside functions and ``if TYPE_CHECKING:`` blocks: a lazy
import still ties two modules together, and a cycle through one is a cycle (see
docs/architecture.md for the rooms and the direction of imports).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attnviz"

MAX_LINES = 800
# Deliberate exceptions to MAX_LINES, each with its reason. Empty: keep it that way if you can.
LONG_MODULES: dict[str, str] = {}

# The floors of docs/architecture.md, bottom to top: a module imports only from its own floor or
# below (the longest matching prefix names a module's floor).
FLOORS: dict[str, int] = {
    "attnviz.errors": 0, "attnviz._version": 0, "attnviz.selection": 0, "attnviz.inputs": 0,
    "attnviz.csvtext": 0, "attnviz.checks": 0,
    "attnviz.fileio": 1, "attnviz.diskfull": 1, "attnviz.reading": 1,
    "attnviz.capture": 2, "attnviz.capture_format": 2, "attnviz.capture_build": 2,
    "attnviz.capture_files": 2,
    "attnviz.models": 3, "attnviz.analysis": 3, "attnviz.measures": 3, "attnviz.long": 3,
    "attnviz.render": 4,
    "attnviz.cache": 5, "attnviz.stream": 5, "attnviz.request": 5, "attnviz.batches": 5,
    "attnviz.session": 5, "attnviz.long_session": 5,
    "attnviz.export": 6, "attnviz.notebook": 6, "attnviz.notebook_long": 6, "attnviz.server": 6,
    "attnviz.engine": 6,
    "attnviz.cli": 7, "attnviz.__main__": 7,
    "attnviz": 8,
}

# The capture record sits low: it may import only these (and its own helper modules).
CAPTURE_MAY_IMPORT = {"attnviz.errors", "attnviz.selection", "attnviz.fileio", "attnviz.inputs",
                      "attnviz._version", "attnviz.diskfull", "attnviz.reading"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    yield source
    for alias in node.names:  # `from attnviz import cache` imports the module attnviz.cache
        yield f"{source}.{alias.name}"


def import_graph() -> dict[str, set[str]]:
    """Module -> the attnviz modules it imports anywhere in its body."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, name, path.name == "__init__.py"):
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts and ".".join(parts) != name:
                    found.add(".".join(parts))
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walker_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_walker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    source = "def f():\n    from . import sibling\n    from attnviz.capture import Capture\n"
    tree = ast.parse(source)
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    seen = {t for node in nodes for t in _targets(node, "attnviz.render.heatmap", False)}
    assert "attnviz.render.sibling" in seen and "attnviz.capture" in seen


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles in attnviz/: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_the_package_root() -> None:
    """The root re-exports the public API, so it sits above every module."""
    importers = sorted(name for name, deps in import_graph().items()
                       if "attnviz" in deps and name != "attnviz")
    assert not importers, f"modules importing the package root: {importers}"


def floor_of(module: str) -> int | None:
    parts = module.split(".")
    while parts:
        if ".".join(parts) in FLOORS:
            return FLOORS[".".join(parts)]
        parts.pop()
    return None


def test_every_module_has_a_floor() -> None:
    missing = sorted(name for name in _modules() if floor_of(name) is None)
    assert not missing, f"give these modules a floor in FLOORS and docs/architecture.md: {missing}"


def test_imports_flow_down() -> None:
    upward = sorted(f"{name} (floor {floor_of(name)}) imports {dep} (floor {floor_of(dep)})"
                    for name, deps in import_graph().items() for dep in deps
                    if (floor_of(dep) or 0) > (floor_of(name) or 0))
    assert not upward, "imports that run up the floors:\n" + "\n".join(upward)


def test_capture_record_imports_nothing_above_it() -> None:
    graph = import_graph()
    for name, deps in graph.items():
        if name == "attnviz.capture" or name.startswith("attnviz.capture_"):
            above = {d for d in deps if d not in CAPTURE_MAY_IMPORT
                     and not (d == "attnviz.capture" or d.startswith("attnviz.capture_"))}
            assert not above, f"{name} imports {sorted(above)}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_size(name: str) -> None:
    path = _modules()[name]
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if name in LONG_MODULES:
        return
    assert lines <= MAX_LINES, (f"{path.relative_to(PACKAGE.parent)} has {lines} lines (limit "
                                f"{MAX_LINES}): split it along its jobs, see docs/architecture.md")


def test_long_module_exceptions_are_still_needed() -> None:
    for name, reason in LONG_MODULES.items():
        path = _modules()[name]
        assert reason.strip(), f"{name}: give the reason for the exception"
        assert len(path.read_text(encoding="utf-8").splitlines()) > MAX_LINES, (
            f"{name} is back under {MAX_LINES} lines: remove its exception")
