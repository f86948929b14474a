"""The server package's shape: no import cycle inside it (the whole tree's circles and layers:
tests/test_import_layers.py), its routes split by job, and vSurge satisfies the protocol the server
needs from an engine (so the server never reaches into drivers)."""

from __future__ import annotations

import pathlib
import sys

from vsurge import vSurge
from vsurge.server.served_model import ServedEngine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the tree's import graph
from import_graph import find_cycle, import_graph  # noqa: E402 - the whole tree's walk: tests/test_import_layers.py


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
