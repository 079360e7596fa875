"""The house plan (``docs/architecture.md``), held against the source: who imports whom.

Every ``import`` of our own modules is an edge, wherever it is written (a function-level
import is still a dependency). ``from package import name`` is an edge to the submodule
``package.name`` when there is one, else to the package itself (its ``__init__``).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "docs" / "architecture.md"
TOP_LEVEL_MODULES = ("celeryconfig",)
TESTS = "tests"


def floors_of_the_plan(text: str) -> dict[str, int]:
    """Each module pattern of the plan's floor table → its floor."""
    table = text.split("<!-- floors: read by tests/test_rooms.py -->", 1)[1].split("<!-- end floors -->", 1)[0]
    floors: dict[str, int] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        for pattern in re.findall(r"`([\w.*]+)`", cells[2]):
            assert pattern not in floors, f"{pattern} is in two rows of the plan"
            floors[pattern] = int(cells[0])
    return floors


def packages_of_the_plan(floors: dict[str, int]) -> tuple[str, ...]:
    return tuple(sorted({p.split(".")[0] for p in floors} - set(TOP_LEVEL_MODULES)))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages: tuple[str, ...], top_level: tuple[str, ...] = TOP_LEVEL_MODULES) -> dict[str, set[str]]:
    """Each of our modules → the modules of ours it imports (``tests`` counts as ours, to be refused)."""
    ours = set(packages) | set(top_level) | {TESTS}
    files = {_module_name(p): p for package in packages for p in (ROOT / package).rglob("*.py")}
    files.update({name: ROOT / f"{name}.py" for name in top_level})
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.split(".")[0] in ours}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up ``level - 1`` steps
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] in ours:
                    found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = found - {name}
    return graph


def pattern_of(module: str, floors: dict[str, int]) -> str | None:
    """The plan's row for a module: its exact name, else the longest ``x.*`` above it."""
    if module in floors:
        return module
    parts = module.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        pattern = ".".join(parts[:cut]) + ".*"
        if pattern in floors:
            return pattern
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def floors() -> dict[str, int]:
    return floors_of_the_plan(PLAN.read_text())


@pytest.fixture(scope="module")
def graph(floors) -> dict[str, set[str]]:
    return import_graph(packages_of_the_plan(floors))


def test_the_plan_and_the_graph_are_read(floors, graph):
    """The rules below are only as good as what they read: the rows and edges we know of."""
    assert floors["models.*"] == 0 and floors["voice_tools.*"] > floors["app.*"] > floors["tasks.calls.*"]
    assert "tasks.celery_app" in graph["tasks.chains"]
    assert "models.lifecycle" in graph["tasks.calls.actions"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert pattern_of("tasks.delivery.events", {"tasks.*": 1, "tasks.delivery.*": 2}) == "tasks.delivery.*"
    assert package_graph({"a.x": {"b.y", "a.z"}, "a.z": set(), "b.y": set()}) == {"a": {"b"}, "b": set()}
    assert floor_bands({"a.*": 2, "a.x": 5}, {"a.x": set(), "a.y": set()}) == {"a": (2, 5)}


def test_every_module_has_one_row_and_every_row_a_module(floors, graph):
    assert sorted(m for m in graph if pattern_of(m, floors) is None) == []
    used = {pattern_of(m, floors) for m in graph}
    assert sorted(set(floors) - used) == []


def test_no_module_of_ours_imports_one_that_imports_it(graph):
    assert cycles(graph) == []


def test_no_import_climbs_a_floor(floors, graph):
    climbs = sorted(f"{a} ({floors[pattern_of(a, floors)]}) -> {b} ({floors[pattern_of(b, floors)]})"
                    for a, targets in graph.items() for b in targets
                    if b in graph and floors[pattern_of(b, floors)] > floors[pattern_of(a, floors)])
    assert climbs == []


def package_of(module: str) -> str:
    """The top-level package (or module, ``celeryconfig``) a module of ours is in."""
    return module.split(".")[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each top-level package of ours → the other top-level packages its modules import."""
    found: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, targets in graph.items():
        found[package_of(module)] |= {package_of(b) for b in targets if b in graph} - {package_of(module)}
    return found


def floor_bands(floors: dict[str, int], graph: dict[str, set[str]]) -> dict[str, tuple[int, int]]:
    """Each top-level package → the lowest and the highest floor of its modules."""
    bands: dict[str, tuple[int, int]] = {}
    for module in graph:
        floor, package = floors[pattern_of(module, floors)], package_of(module)
        low, high = bands.get(package, (floor, floor))
        bands[package] = (min(low, floor), max(high, floor))
    return bands


def test_the_top_level_packages_import_each_other_in_no_circle(graph):
    """A folder is a room or a few rooms, one above another: no package imports one that imports it back."""
    assert cycles(package_graph(graph)) == []


def test_each_top_level_package_sits_on_a_floor_band_of_its_own(floors, graph):
    """What a package imports of another package is on floors no higher than any of its own: the folders show
    the floors (a package of the ground imports no package holding a room upstairs)."""
    bands = floor_bands(floors, graph)
    overlaps = sorted(f"{a} {bands[a]} -> {b} {bands[b]}" for a, targets in package_graph(graph).items()
                      for b in targets if bands[b][1] > bands[a][0])
    assert overlaps == []


def test_nothing_outside_the_tests_imports_them(graph):
    assert sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if b.split(".")[0] == TESTS) == []


def test_the_tasks_package_modules_take_the_app_from_celery_app_not_from_the_package(graph):
    """``tasks/__init__.py`` imports the task modules; one of them importing the package back
    would be a circle."""
    back = sorted(name for name, targets in graph.items() if name.startswith("tasks.") and "tasks" in targets)
    assert back == []


def imports_of_outside(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports anywhere in it (a function-level import too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """``start`` and every module of ours it imports, directly or not, a function-level import too."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def test_the_stream_loop_reaches_no_flask(graph):
    """The MCP face (uvicorn) holds the stream loop for its waits: neither the loop nor any module of ours it
    imports, even inside a function (the gauges of a stream served, the shares), imports Flask."""
    def path(module: str) -> Path:
        folder = ROOT / module.replace(".", "/")
        return folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")

    with_flask = sorted(m for m in reached(graph, "app.stream_loop") if m in graph
                        and "flask" in imports_of_outside(path(m)))
    assert with_flask == []
