"""The import structure of `grpod/`: no cycle between modules and none between packages.

Every import counts, the ones inside functions included: a function-level import added to dodge a
cycle closes the same cycle here (only imports under `if TYPE_CHECKING:` are left out, since they
never run). Packages (`grpod.daemon`, `grpod.agent`, ...) must not import each other both ways
either: a shared service belongs in a room both may use (`grpod.service`). The checker is tested
on a planted cycle so that a broken checker cannot pass silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in the module but TYPE_CHECKING blocks)."""
    modules = {_module_name(p, package_dir): p for p in package_dir.rglob("*.py")}
    top = package_dir.name

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                targets: list[str] = []
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        package = name.split(".") if is_package else name.split(".")[:-1]
                        package = package[: len(package) - child.level + 1]
                        base = ".".join(package + ([base] if base else []))
                    targets = [base] + [f"{base}.{alias.name}" for alias in child.names]
                for target in targets:
                    if target == top or target.startswith(top + "."):
                        found = resolve(target)
                        if found and found != name:
                            edges.add(found)
                visit(child)

        visit(ast.parse(path.read_text()))
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same arrows between sub-packages (`grpod.daemon` -> `grpod.agent`)."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    arrows: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            if package(module) != package(target):
                arrows.setdefault(package(module), set()).add(package(target))
    return arrows


def test_grpod_has_no_import_cycle_between_modules():
    assert cycles(import_graph(ROOT / "grpod")) == []


def test_grpod_packages_do_not_import_each_other_both_ways():
    assert cycles(package_graph(import_graph(ROOT / "grpod"))) == []


def test_the_checker_finds_a_planted_cycle_through_a_function_level_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "daemon").mkdir(parents=True)
    (package / "agent").mkdir()
    for init in (package, package / "daemon", package / "agent"):
        (init / "__init__.py").write_text("")
    (package / "daemon" / "logs.py").write_text("def configure():\n    pass\n")
    (package / "daemon" / "supervisor.py").write_text("from pkg.agent.remote import engines\n")
    (package / "agent" / "remote.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.daemon.supervisor import Supervisor\n"
        "def engines():\n    from pkg.daemon import logs\n"  # an arrow up, dodged inside a function
    )
    (package / "daemon" / "components.py").write_text("from . import step_loop\n")
    (package / "daemon" / "step_loop.py").write_text("def f():\n    from .components import x\n")
    graph = import_graph(package)
    assert cycles(graph) == [["pkg.daemon.components", "pkg.daemon.step_loop"]]
    assert cycles(package_graph(graph)) == [["pkg.agent", "pkg.daemon"]]
    assert "pkg.daemon.supervisor" not in graph["pkg.agent.remote"]  # TYPE_CHECKING never runs
