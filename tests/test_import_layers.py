"""The whole tree's import picture (service/, operator/, benchmarks/): no import circle, and no import that
runs from a lower layer up into a higher one.

The layer order is written once, in vsurge/layers.py (LAYERS, lowest first, and SEPARATE: the router and
the operator beside the stack); its docstring says what each layer holds. docs/architecture.md lists the
same layers in the same order, and says the same rule: each imports only its own layer and the ones below.
"""

from __future__ import annotations

import re

from import_graph import REPO, circles, import_graph, module_files

from vsurge.layers import LAYERS, SEPARATE

ARCHITECTURE = REPO / "docs" / "architecture.md"
RULE = "imports only its own layer and the ones below"


def layer_of(module: str) -> str:
    """The layer (or separate package) a module belongs to: the longest prefix that names it."""
    best, best_len = None, -1
    names = [(name, prefix) for name, prefixes in LAYERS for prefix in prefixes]
    names += [(prefix, prefix) for prefix in SEPARATE]
    for name, prefix in names:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
            best, best_len = name, len(prefix)
    if best is None:
        raise LookupError(f"{module} is in no layer: add it to LAYERS or SEPARATE in {__name__}")
    return best


def back_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports that run against the layer order: lower into higher, or across a separate package's fence."""
    rank = {name: i for i, (name, _) in enumerate(LAYERS)}
    bad = []
    for mod, targets in sorted(graph.items()):
        src = layer_of(mod)
        for target in sorted(targets):
            dst = layer_of(target)
            if src == dst or target == mod:
                continue
            if src in SEPARATE:
                ok = dst in SEPARATE[src][0]
            elif dst in SEPARATE:
                ok = src in SEPARATE[dst][1]
            else:
                ok = rank[dst] <= rank[src]
            if not ok:
                bad.append((mod, target))
    return bad


def test_every_module_has_a_layer():
    for module in module_files():
        layer_of(module)  # raises for a module nobody placed


def test_no_import_circle_anywhere():
    graph = import_graph()
    assert "vsurge.router.cli" in graph["vsurge.cli.main"]  # the graph sees the cli's subcommand modules
    assert "benchmarks.peers" in graph["benchmarks.serving_peers"]  # and the benchmarks' bare-name imports
    assert circles(graph) == []


def test_no_import_runs_back_up_the_layers():
    assert back_arrows(import_graph()) == []


def test_the_checks_can_fail():
    assert circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a": {"a.x"}}) == [["a.x", "a.y", "a.z"]]
    graph = {
        "vsurge.models.llama": {"vsurge.engines.dense.vengine"},  # models must not know engines
        "vsurge.engines.dense.vengine": {"vsurge.models.llama"},
        # the router: contracts only
        "vsurge.router.app": {"vsurge.engines.dense.vengine", "vsurge.contracts.env_options"},
        "vsurge.server.app": {"vsurge.router.app"},  # only the cli registers the router
        "vsurge.cli.main": {"vsurge.router.cli"},
        "vsurge.router.cli": set(),
        "vsurge.engines.dense.vengine.x": set(),
        "vsurge.contracts.env_options": set(),
    }
    assert back_arrows(graph) == [
        ("vsurge.models.llama", "vsurge.engines.dense.vengine"),
        ("vsurge.router.app", "vsurge.engines.dense.vengine"),
        ("vsurge.server.app", "vsurge.router.app"),
    ]


def documented_layers(text: str) -> list[str]:
    """The layer names of architecture.md's "## Layers" list (`1. **name** ...`), in order."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. \*\*([\w/]+)\*\*", section, flags=re.M)


def test_architecture_md_lists_the_layers_and_their_rule():
    text = ARCHITECTURE.read_text()
    assert documented_layers(text) == [name for name, _ in LAYERS]
    assert RULE in " ".join(text.split())  # the rule as the test checks it, across a line break too
    assert "only calls the one below" not in text


def test_the_doc_check_can_fail():
    doc = "x\n## Layers\n\n1. **contracts** - a\n2. **models** - b\n\n## Next\n3. **cli** - c\n"
    assert documented_layers(doc) == ["contracts", "models"]  # one layer missing: differs from LAYERS


def test_the_core_does_not_import_the_seed():
    # the seed's API is an edge: only the facade (and scripts over everything) reach into vsurge.seed_api
    graph = import_graph()
    above = {"seed", "facade", "benchmarks"}
    assert [
        (m, t)
        for m, ts in sorted(graph.items())
        for t in sorted(ts)
        if layer_of(t) == "seed" and layer_of(m) not in above
    ] == []
    assert layer_of("vsurge.seed_api.surge") == layer_of("vsurge.seed_api.engines") == "seed"
