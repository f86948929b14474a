"""benchmarks/tpu_probe_layer_scan.py in its reduced form (the tiny shape on CPU, float32): every program runs
both ways, and the layer scan (S) computes what the model's unrolled forward (U) does, so the probe cannot
rot, or measure a wrong S, between runs on a lent chip."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tpu_probe_layer_scan as probe  # noqa: E402


def test_reduced_scan_matches_unrolled(tmp_path, capsys):
    out = tmp_path / "scan.json"
    # the big prefill is the small one's code at another length: left out to keep the test quick
    args = ["--reduced", "--compile-cache", "--skip", "prefill_big", "--out", str(out)]
    assert probe.main(args) == 0
    results = json.loads(out.read_text())
    assert results["errors"] == []
    assert all(isinstance(v, dict) for v in results["sections"].values()), results["sections"]
    got = {(r["program"], r["variant"]) for r in results["rows"]}
    assert got == {(p, v) for p in ("prefill_small", "decode") for v in "US"}
    for r in results["rows"]:
        assert r["compile_s"] > 0 and r["lower_s"] > 0 and r["run_ms"] > 0, r
    assert {c["program"] for c in results["compare"]} == {"prefill_small", "decode"}
    for c in results["compare"]:
        for key in ("hidden", "k", "v", "logits"):
            assert c[f"{key}_maxdiff"] <= 1e-5 * max(1.0, c[f"{key}_maxabs"]), c
        assert c["argmax_agree"] == 1.0, c
    assert "compile U/S" in capsys.readouterr().out
