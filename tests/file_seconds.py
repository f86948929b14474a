"""Each test file's seconds in the last measured runs, so `make test` starts the longest files first.

xdist's file scheduler hands out files in collection order (or, by default, most tests first): the
costliest files, a few tests each (the multi-host groups, structured output on the default model), then
started last and one worker ran them alone at the end while the other idled. The hook below (registered
by tests/conftest.py) orders the collected files by these seconds, longest first (xdist's reordering
off, tests/xdist_files.py), and each worker takes the next file when it is free: the longest-first rule
that packs the workers within one file's time of the ideal. A file missing here counts as `UNKNOWN_S`; stale numbers only cost speed.

Refresh from the junit files of a full run and a `make test-fast` run:

    make test ARGS=--junitxml=/tmp/full.xml; make test-fast ARGS=--junitxml=/tmp/fast.xml
    .venv/bin/python tests/file_seconds.py /tmp/full.xml /tmp/fast.xml > tests/file_seconds.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest
from xdist_files import scope_of

UNKNOWN_S = 5.0
TABLE = Path(__file__).with_name("file_seconds.json")
ROOT = Path(__file__).resolve().parents[1]


def _file_of(classname: str) -> str:
    """junit's classname (tests.service.test_x or tests.service.test_x.TestClass) -> tests/service/test_x.py"""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if (ROOT / path).exists():
            return path
    return "/".join(parts) + ".py"


def file_seconds(junit: str) -> dict[str, float]:
    """{test file: seconds of its tests, setup and teardown included} from a pytest junit xml."""
    out: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        out[_file_of(case.get("classname", ""))] += float(case.get("time", 0))
    return {k: round(v, 1) for k, v in sorted(out.items())}


def load() -> dict[str, dict[str, float]]:
    return json.loads(TABLE.read_text())


def scope_seconds(nodeids: list[str], table: dict[str, float]) -> dict[str, float]:
    """Seconds per scheduling unit (tests/xdist_files.scope_of) of these tests' files."""
    out: Counter[str] = Counter()
    for path in {nid.split("::", 1)[0] for nid in nodeids}:
        out[scope_of(path)] += table.get(path, UNKNOWN_S)
    return dict(out)


def longest_first(nodeids: list[str], table: dict[str, float]) -> list[int]:
    """The order (indices into ``nodeids``) that runs whole units longest first, each unit's tests in
    their collected order."""
    cost = scope_seconds(nodeids, table)
    first = {}
    for i, nid in enumerate(nodeids):
        first.setdefault(scope_of(nid), i)
    return sorted(
        range(len(nodeids)), key=lambda i: (-cost[scope_of(nodeids[i])], first[scope_of(nodeids[i])], i)
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """After -m has deselected: the longest files first, each file's tests in order; xdist's workers then
    take whole files in this order (tests/xdist_files.py)."""
    tables = load()
    table = tables["fast"] if "not slow" in (config.getoption("markexpr", "") or "") else tables["full"]
    order = longest_first([item.nodeid for item in items], table)
    items[:] = [items[i] for i in order]


if __name__ == "__main__":
    full, fast = sys.argv[1:3]
    print(json.dumps({"full": file_seconds(full), "fast": file_seconds(fast)}, indent=1))
