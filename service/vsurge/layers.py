"""The layers of the tree (service/, operator/, benchmarks/), lowest first: a module may import its own
layer and the ones below, never one above. tests/test_import_layers.py checks every import against this
order, and docs/architecture.md's list of layers against these names.

1. contracts  - what every layer speaks: EngineConfig and its env/flag parsing, SamplingParams, the request
                and its results, the token budget (`contracts/`); the version; this map. No jax.
2. structured - grammars and token masks for structured output (`structured/`).
3. models     - model definitions, loaders, sources, attention kernels, and the compiled programs kept
                across starts: JAX's compilation cache, the executable store (`models/`, `models/compiled/`).
4. engines    - the jitted programs over a model's state (`engines/`: dense/ vEngine,
                paged/ oEngine, sampling/ the sampler; at its root what both share, and resolved_config).
5. drivers    - the threads that feed the engines: pipeline, slots, detokenizer (`drivers/`).
6. surge      - vSurge: the engine a server talks to (`surge.py`).
7. server, multihost - the HTTP server; a multi-host slice's lockstep lane (both over surge).
8. cli        - `vsurge serve | route | bench` and --print-config (`cli/`).
9. seed       - the seed's API as an edge over the core (`seed_api/`): vSurge, vSurgeRequest and the seed's
                constructors; nothing below imports it.
10. facade    - the `vsurge` package itself: its lazy names reach every layer.
11. benchmarks - scripts over everything.

Two packages stand beside the stack (``SEPARATE``): the router (`vsurge route`) and the operator. Each
imports only the contracts layer (the control plane installs without jax), and only the layers named may
import it (the router's command registers with the cli; nothing imports the operator).

A module is placed by the longest prefix that names it, so `vsurge` (the facade) holds only what no
longer prefix claims.
"""

from __future__ import annotations

# (layer, module-name prefixes), lowest first
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "contracts",
        (
            "vsurge.contracts",
            "vsurge.version",
            "vsurge.layers",
        ),
    ),
    ("structured", ("vsurge.structured",)),
    ("models", ("vsurge.models",)),
    ("engines", ("vsurge.engines",)),
    ("drivers", ("vsurge.drivers",)),
    ("surge", ("vsurge.surge",)),
    ("server/multihost", ("vsurge.server", "vsurge.multihost")),
    ("cli", ("vsurge.cli",)),
    ("seed", ("vsurge.seed_api",)),
    ("facade", ("vsurge",)),
    ("benchmarks", ("benchmarks",)),
)

# package prefix -> (layers it may import besides itself, layers that may import it)
SEPARATE: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "vsurge.router": (frozenset({"contracts"}), frozenset({"cli", "facade", "benchmarks"})),
    "vsurge_operator": (frozenset({"contracts"}), frozenset()),
}
