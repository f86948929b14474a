"""benchmarks/device_check.py in its reduced form (tiny shapes on CPU): it runs, its figures add up, its greedy
parity holds, and the peak-bandwidth table knows the devices it names, so it cannot rot between device runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import device_check  # noqa: E402


@pytest.mark.parametrize(
    ("kind", "gbps"),
    [
        ("NVIDIA H200", 4800),
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("NVIDIA L4", 300),
        ("TPU v4", 1200),
        ("TPU v5 lite", 819),
        ("TPU v5p", 2765),
        ("TPU v6 lite", 1640),
        ("cpu", None),
        ("Some New Chip", None),
    ],
)
def test_peak_bandwidth_table(kind, gbps):
    assert device_check.peak_gbps(kind) == gbps


def test_reduced_run(capsys):
    result = device_check.run(device_check.parse_args(["--reduced"]))
    out = capsys.readouterr().out
    assert "device: cpu" in out and "% peak" in out and "n/a" in out
    rows = result["rows"]
    configs = {(r["weights"], r["attention"], r["batch"]) for r in rows}
    assert configs == {(w, a, b) for w in ("bf16", "int8") for a in ("dense", "paged") for b in (1, 4)}
    for r in rows:
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_s"])
        assert r["gbps"] == pytest.approx((r["weight_bytes"] + r["kv_bytes"]) / r["step_s"] / 1e9)
        assert r["peak_share"] is None  # CPU: no peak figure
    by = {(r["weights"], r["attention"], r["batch"]): r for r in rows}
    # int8 weights are about half of bf16; the KV read is the same for both layouts
    assert by["int8", "dense", 1]["weight_bytes"] < 0.6 * by["bf16", "dense", 1]["weight_bytes"]
    assert (
        by["bf16", "paged", 4]["kv_bytes"]
        == by["bf16", "dense", 4]["kv_bytes"]
        == 4 * by["bf16", "dense", 1]["kv_bytes"]
    )
    assert [(c["weights"], c["attention"]) for c in result["parity"]] == [
        ("f32", "dense"),
        ("f32", "paged"),
        ("int8", "dense"),
        ("int8", "paged"),
    ]
    assert all(c["ok"] for c in result["parity"]), result["parity"]
    assert all(len(set(c["want"])) > 2 for c in result["parity"]), result["parity"]  # not one repeated token
