"""The project's import graph: no cycles between its modules, counting imports made only for type checking (each one
is a sign that two modules hold one concept between them: a Protocol or a split says which owns what), and the
command line on top (nothing in engine/, gateway/, loragate_kernels/, loragate_common/ or vllm_agent/ imports
loragate/)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "gateway", "loragate_kernels", "loragate_common", "loragate", "vllm_agent")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body (module level, functions, TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (module -> modules it imports) as [a, b, ..., a], or None. A package importing
    its own submodules (`pkg/__init__.py`) is not a cycle by itself, so those edges are left out."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def project_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    known = {module_name(p) for p in files}
    graph = {module_name(p): imports(p, known) - {module_name(p)} for p in files}
    assert len(graph) > 50  # the walk found the project
    return graph


def test_no_import_cycles_between_project_modules() -> None:
    cycle = find_cycle(project_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_command_line_is_at_the_top_of_the_graph() -> None:
    graph = project_graph()
    below = {
        module: sorted(name for name in imported if name.split(".")[0] == "loragate")
        for module, imported in graph.items()
        if module.split(".")[0] != "loragate"
    }
    assert {module: names for module, names in below.items() if names} == {}
    assert any(name.startswith("engine.") for name in graph["loragate.engine_cli"])  # the walk sees the CLI


def test_the_checker_finds_a_cycle_through_a_type_only_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import A\n")
    known = {"a", "b"}
    graph = {name: imports(tmp_path / f"{name}.py", known) for name in known}
    assert graph == {"a": {"b"}, "b": {"a"}}
    assert find_cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])
    assert find_cycle({"a": {"b"}, "b": set()}) is None
