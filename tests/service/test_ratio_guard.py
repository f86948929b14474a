"""The CPU speed guard (benchmarks/ratio_guard.py): `.ci/run`'s "guard" stage runs it on the default model,
alone on the machine, and fails below 0.5x. Here it runs whole on the tiny model, so a change to an API it
drives breaks the suite, not the stage; and its verdict is the ratio.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

import vsurge

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")  # tests/service -> repo
sys.path.insert(0, BENCH)
import ratio_guard  # noqa: E402


@pytest.mark.slow  # five engines compiled
def test_every_check_runs_and_reports_a_ratio(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    model, tok = vsurge.load_model(path)
    lines: list[str] = []
    tiny = dict(max_concurrent_decodes=8, max_length=128, prefill_lengths=[64])
    checks = ratio_guard.run(model, tok, passes=1, say=lines.append, serve=tiny, small=tiny)
    print("\n".join(lines))
    names = [c["name"] for c in checks]
    assert names == [
        "vdriver x1",
        "vdriver x8",
        "structured",
        "odriver x1",
        "odriver x8",
        "ngram x1",
        "lora x8",
    ]
    assert all(c["ours"] > 0 and c["base"] > 0 and math.isfinite(c["ratio"]) for c in checks), lines
    assert len(lines) == len(checks)


def test_the_verdict_is_the_ratio():
    made = [dict(name="slow", ratio=0.3), dict(name="fine", ratio=0.6)]
    assert [c["name"] for c in ratio_guard.failures(made, 0.5)] == ["slow"]


def test_the_ci_stage_runs_the_guard():
    out = subprocess.run(
        ["make", "-n", "guard"], capture_output=True, text=True, cwd=os.path.join(BENCH, "..")
    )
    assert "benchmarks/ratio_guard.py" in out.stdout, out.stdout + out.stderr
    with open(os.path.join(BENCH, "..", ".ci", "run")) as f:
        assert "stages=${CI_STAGES:-serve guard test}" in f.read()
