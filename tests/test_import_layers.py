"""The whole tree's import picture (service/, operator/, benchmarks/): no import circle, and no import that
runs from a lower layer up into a higher one.

The layer order, lowest first (``LAYERS``; a module may import its own layer and the ones below):

1. contracts  - what every layer speaks: EngineConfig and its env/flag parsing, SamplingParams, the
                request and its results, the seed's argument helpers, the version. No jax.
2. structured - grammars and token masks for structured output.
3. models     - model definitions, loaders, sources, attention kernels (and the compilation cache's place:
                JAX's, its reads, the executable store).
4. engines    - the jitted programs over a model's state (and resolved_config, which asks them).
5. drivers    - the threads that feed the engines (pipeline, slots, detokenizer).
6. surge      - vSurge: the engine a server talks to.
7. server, multihost - the HTTP server; a multi-host slice's lockstep lane (both over surge).
8. cli        - `vsurge serve | route | bench` and --print-config.
9. facade     - the `vsurge` package itself: its lazy names reach every layer.
10. benchmarks - scripts over everything.

Two packages stand beside the stack (``SEPARATE``): the router (`vsurge route`) and the operator. Each
imports only the contracts layer (the control plane installs without jax), and only the layers named
may import it (the router's command registers with the cli; nothing imports the operator).
"""

from __future__ import annotations

from import_graph import circles, import_graph, module_files

# (layer, module-name prefixes), lowest first
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "contracts",
        (
            "vsurge.version",
            "vsurge.env_options",
            "vsurge.sampling_params",
            "vsurge.engine_config",
            "vsurge.seed_args",
            "vsurge.request",
            "vsurge.responses",
            "vsurge.protocols",
            "vsurge.token_budget",
        ),
    ),
    ("structured", ("vsurge.structured",)),
    (
        "models",
        (
            "vsurge.models",
            "vsurge.compilation_cache",
            "vsurge.cache_reads",
            "vsurge.executable_store",
            "vsurge.cache_signing",
        ),
    ),
    ("engines", ("vsurge.engines", "vsurge.resolved_config")),
    ("drivers", ("vsurge.drivers",)),
    ("surge", ("vsurge.surge",)),
    ("server/multihost", ("vsurge.server", "vsurge.multihost")),
    ("cli", ("vsurge.cli", "vsurge.serve_options", "vsurge.print_config", "vsurge.sizing")),
    ("facade", ("vsurge",)),
    ("benchmarks", ("benchmarks",)),
)
# package prefix -> (layers it may import besides itself, layers that may import it)
SEPARATE: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "vsurge.router": (frozenset({"contracts"}), frozenset({"cli", "facade", "benchmarks"})),
    "vsurge_operator": (frozenset({"contracts"}), frozenset()),
}


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
    assert "vsurge.router.cli" in graph["vsurge.cli"]  # the graph sees the cli's subcommand modules
    assert "benchmarks.peers" in graph["benchmarks.serving_peers"]  # and the benchmarks' bare-name imports
    assert circles(graph) == []


def test_no_import_runs_back_up_the_layers():
    assert back_arrows(import_graph()) == []


def test_the_checks_can_fail():
    assert circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a": {"a.x"}}) == [["a.x", "a.y", "a.z"]]
    graph = {
        "vsurge.models.llama": {"vsurge.engines.vengine"},  # models must not know engines
        "vsurge.engines.vengine": {"vsurge.models.llama"},
        "vsurge.router.app": {"vsurge.engines.vengine", "vsurge.env_options"},  # the router: contracts only
        "vsurge.server.app": {"vsurge.router.app"},  # only the cli registers the router
        "vsurge.cli": {"vsurge.router.cli"},
        "vsurge.router.cli": set(),
        "vsurge.engines.vengine.x": set(),
        "vsurge.env_options": set(),
    }
    assert back_arrows(graph) == [
        ("vsurge.models.llama", "vsurge.engines.vengine"),
        ("vsurge.router.app", "vsurge.engines.vengine"),
        ("vsurge.server.app", "vsurge.router.app"),
    ]
