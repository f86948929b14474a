"""No module over 500 lines outside tests (service/, operator/, benchmarks/): a module that grows past it
holds more than one job and is split along a seam that has a name (issue 31)."""

from __future__ import annotations

import pathlib

from import_graph import module_files

MAX_LINES = 500


def oversized(files: dict[str, pathlib.Path], limit: int = MAX_LINES) -> dict[str, int]:
    """Module -> its line count, for those over ``limit``."""
    counts = {mod: len(path.read_text().splitlines()) for mod, path in files.items()}
    return {mod: n for mod, n in sorted(counts.items()) if n > limit}


def test_no_module_over_500_lines():
    files = module_files()
    # the walk sees every root
    assert "vsurge.engines.dense.vengine" in files and "benchmarks.serving" in files
    assert oversized(files) == {}


def test_the_size_check_can_fail():
    files = module_files()
    biggest = max(files, key=lambda m: len(files[m].read_text().splitlines()))
    n = len(files[biggest].read_text().splitlines())
    assert oversized(files, limit=n - 1) == {biggest: n}
