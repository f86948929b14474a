"""The import graph of the repository's code (service/, operator/, benchmarks/), read statically with ast.

Every import counts, at any depth of a file (lazy imports inside functions and ``TYPE_CHECKING`` blocks
too): a circle through a lazy import is still two modules that cannot be understood apart. Imports by
name count as well: in a module that calls ``importlib.import_module``, every string literal naming a
module of the tree by its dotted name is an edge, so a circle cannot hide behind importlib.

Benchmarks are scripts run with benchmarks/ on sys.path; they import each other by bare name
(``import serving``), which resolves here to ``benchmarks.serving``.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
# package (or script folder) name -> its directory
ROOTS = {
    "vsurge": REPO / "service" / "vsurge",
    "vsurge_operator": REPO / "operator" / "vsurge_operator",
    "benchmarks": REPO / "benchmarks",
}


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file under the roots."""
    modules = {}
    for top, folder in ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _targets(node: ast.AST, package: str, known: dict[str, pathlib.Path]) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # `from pkg import mod` imports the module; `from mod import name` the module the name lives in
        return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def _uses_importlib(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == "import_module"
        and getattr(n.value, "id", "") == "importlib"
        for n in ast.walk(tree)
    )


def import_graph(modules: dict[str, pathlib.Path] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (statically, or by name through importlib)."""
    modules = module_files() if modules is None else modules
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        names: list[str] = []
        for node in ast.walk(tree):
            names += _targets(node, package, modules)
        if _uses_importlib(tree):
            # a dotted literal ("vsurge.router.cli"): a module imported by name; a bare word is rarely one
            names += [
                n.value
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and "." in n.value
            ]
        for name in names:
            if mod.startswith("benchmarks.") and f"benchmarks.{name}" in graph:
                name = f"benchmarks.{name}"  # a script's sibling, imported by bare name
            if name in graph and name != mod:
                graph[mod].add(name)
    return graph


def _edges(graph: dict[str, set[str]], m: str, nodes: set[str]) -> list[str]:
    # a package importing its own submodules (re-exports) is not a circle of jobs
    return sorted(n for n in graph[m] & nodes if not n.startswith(m + "."))


def circles(graph: dict[str, set[str]], within: str = "") -> list[list[str]]:
    """The import circles (strongly connected groups of 2+ modules) among modules named ``within*``."""
    nodes = {m for m in graph if m.startswith(within)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in _edges(graph, v, nodes):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for m in sorted(nodes):
        if m not in index:
            visit(m)
    return sorted(found)


def find_cycle(graph: dict[str, set[str]], within: str) -> list[str] | None:
    """One import cycle among modules named ``within*`` as a path that ends where it starts, or None."""
    nodes = {m for m in graph if m.startswith(within)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in _edges(graph, m, nodes):
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
