"""The house plan's floor rules (``DESIGN.md``), read from the source: who imports whom.

Every ``import`` of our own modules is an edge, wherever it is written (a function-level
import is still a dependency). ``from package import name`` is an edge to the submodule
``package.name`` when there is one, else to the package itself (its ``__init__``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "backends", "tasks", "app", "voice_tools")
TOP_LEVEL = ("celeryconfig",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES + TOP_LEVEL


def import_graph() -> dict[str, set[str]]:
    """Each of our modules → the modules of ours it imports."""
    files = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    files.update({name: ROOT / f"{name}.py" for name in TOP_LEVEL})
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if _ours(alias.name)}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up ``level - 1`` steps
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if _ours(base):
                    found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = found - {name}
    return graph


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
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_is_read_from_the_source(graph):
    """The rules below are only as good as the graph: it has the edges we know of."""
    assert "tasks.celery_app" in graph["tasks.chains"]
    assert "models.lifecycle" in graph["tasks.calls.actions"]
    assert "tasks.delivery.transport" in graph["tasks.delivery.attempts"]
    assert "tasks.calls.actions" in graph["tasks"]  # the package registers the task modules
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_ours_imports_one_that_imports_it(graph):
    assert cycles(graph) == []


def test_models_import_nothing_of_ours_but_models(graph):
    upward = {name: sorted(t for t in targets if not t.startswith("models"))
              for name, targets in graph.items() if name.split(".")[0] == "models"}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_backends_import_only_models_and_backends(graph):
    upward = {name: sorted(t for t in targets if not t.startswith(("models", "backends")))
              for name, targets in graph.items() if name.startswith("backends")}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_the_tasks_package_modules_take_the_app_from_celery_app_not_from_the_package(graph):
    """``tasks/__init__.py`` imports the task modules; one of them importing the package back
    would be the circle this layout removed."""
    back = sorted(name for name, targets in graph.items() if name.startswith("tasks.") and "tasks" in targets)
    assert back == []
