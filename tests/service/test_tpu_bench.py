"""The TPU benchmark runs end to end on CPU (benchmarks/tpu_bench.py, the tiny shape), so it cannot rot
between the runs on a lent chip: its worker writes every measurement the chip's tables are built from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tiny_shape_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "service"), JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "tpu_bench.py"),
        "--shapes", "tiny", "--paths", "vdriver", "--budget-s", "400",
        "--warm-start", "", "--correctness", "", "--worker-args", "--chunks 0",
        "--out-dir", str(tmp_path), "--ckpt-dir", str(tmp_path / "ckpt"), "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((tmp_path / "tiny.json").read_text())["runs"][0]
    assert "error" not in run, run
    assert run["raw"]["step_s"] > 0 and run["raw_walks"][0]["walk"] == 32
    fixed = run["fixed"]
    assert fixed["tokens"] == 64 * 32 and fixed["cancelled"] == 0
    assert fixed["decode_tok_s"] > 0 and len(fixed["ttfts"]) == 64
    # the timeline saw every request's first token sampled and inserted
    calls = fixed["timeline"]
    assert calls["insert"]["calls"] == 64 and calls["sample_firsts"]["rows"] == 64
    report = run["compile_report"]
    late = {n for n, _ in report["after_pool"]}
    assert report["programs"] > 10 and not late & set(report["pool"]), report
    assert [p["rows"] for p in run["prefill"]][0] == 1
    assert run["busy_rows"]["fixed"]["tokens"] == 64 * 32
    # mixed: arriving traffic, twice the slots' requests; its limit an estimate at the measured matmul peak
    mixed = run["mixed"]
    assert len(mixed["ttfts"]) == 128 and mixed["cancelled"] == 0 and mixed["vs_limit"] > 0
    worker = json.loads((tmp_path / "tiny.json").read_text())
    assert worker["matmul_peak_measured"] and worker["matmul_peak_flops"] > 1e8
    assert worker["matmul_params"] < worker["params"]  # the untied embedding table is gathered
    table = (tmp_path / "tpu_bench.md").read_text()
    assert "| tiny | vdriver |" in table and "raw walk ms" in table and "busy prefill calls" in table
    assert "its limit is an estimate" in table and "measured on the device" in table
