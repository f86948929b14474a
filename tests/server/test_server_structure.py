"""The server package's shape: no import cycle inside vsurge, and vSurge satisfies the protocol the server
needs from an engine (so the server never reaches into drivers)."""

from __future__ import annotations

import ast
import pathlib

import vsurge
from vsurge.server.engine import ServedEngine
from vsurge.surge import vSurge

ROOT = pathlib.Path(vsurge.__file__).parent


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the vsurge modules it imports, at any depth of the file (lazy imports count too)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name in graph and name != mod:
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]], within: str) -> list[str] | None:
    nodes = {m for m in graph if m.startswith(within)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m] & nodes):
            # a package importing its own submodules (re-exports) is not a cycle of jobs
            if n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(nodes):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_server_package_has_no_import_cycle():
    graph = import_graph()
    assert "vsurge.server.app" in graph["vsurge.server"]  # the graph sees relative imports
    assert find_cycle(graph, "vsurge.server") is None, find_cycle(graph, "vsurge.server")
    # the split by job: lifecycle, generation and the other routes live apart from the app
    assert {"vsurge.server.lifecycle", "vsurge.server.generation", "vsurge.server.info_routes"} <= graph[
        "vsurge.server.app"
    ]
    assert "vsurge.server.app" not in graph["vsurge.server.runner"]


def test_cycle_finder_can_fail():
    assert find_cycle({"a.x": {"a.y"}, "a.y": {"a.x"}}, "a") == ["a.x", "a.y", "a.x"]


def test_vsurge_is_a_served_engine():
    wanted = {n for n in vars(ServedEngine) if not n.startswith("_")}
    assert {"processor", "max_length", "vocab_size", "live", "complete", "tokenize"} <= wanted
    assert not wanted - set(dir(vSurge))
