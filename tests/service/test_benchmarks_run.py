"""Every module of benchmarks/ imports and every entry point runs, so none rots.

An entry point is a file of benchmarks/ with a ``__main__`` block (run as ``python benchmarks/NAME.py``);
the rest are its parts. Each entry point is either run here through its own command line, on the tiny
model or its CPU path, with its smallest flags (those that compile an engine or load a model or a
tokenizer are slow-listed), or named with the test that already runs it. A new entry point that is
neither fails the quick loop, and so does a part that grows a ``__main__`` block.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "service"), os.environ.get("PYTHONPATH", "")]))

# entry point -> (its smallest run, text its output must hold); {model}: a tiny random llama
SMOKE: dict[str, tuple[list[str], str]] = {
    "engine": (
        ["--model", "{model}", "--batches", "1", "--prompt-tokens", "8", "--output-tokens", "4", "--slots", "2",
         "--max-length", "64", "--prefill-lengths", "16", "--skip-hf", "--skip-mixed"],
        "vdriver tok/s",
    ),
    "speculative": (["--model", "{model}", "--rows", "2", "--k", "2", "--tokens", "8"], "ngram"),
    "lora": (["--model", "{model}", "--steps", "2", "--batch", "4"], "4 adapters"),
    "step_breakdown": (["--model", "{model}", "--smoke", "--slots", "2", "--max-length", "256"], "per step"),
    "paged": (["throughput", "--model", "{model}", "--batch", "2", "--rounds", "1", "--smoke"], "odriver"),
    "host_overhead": (["--slots", "4", "--tokens", "4"], "pipeline_row"),
    "sampling_bench": (["--shapes", "2x320", "--impl", "cpu", "--iters", "2", "--repeats", "1"], "greedy"),
    "multihost_step": (["lane", "--calls", "20", "--layers", "2"], "us/call"),
    "structured_mask_bench": (["--reps", "2"], "mask p50"),
    "structured_bench": (["--model", "{model}", "--concurrency", "2", "--max-tokens", "8"], "mask fill"),
    "model_sources": (["--skip-big", "--repeats", "1"], "moto S3"),
}  # fmt: skip

# entry point -> the test that runs it (whole, or the functions its main calls)
RUN_ELSEWHERE = {
    "serving": "tests/server/test_server_benchmarks.py",
    "soak": "tests/server/test_server_benchmarks.py",
    "ratio_guard": "tests/service/test_ratio_guard.py",
    "device_check": "tests/service/test_device_check.py",
    "tpu_bench": "tests/service/test_tpu_bench.py",
    "router_prefix": "tests/router/test_router_e2e_pods.py",
}


# entry point -> why only its argument parsing runs here (the import test parses every entry point's --help)
PARSED_ONLY = {
    "vllm_api_tests": "vLLM's own test files and a Python with vLLM installed (docs/api.md)",
}


def modules() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py"))


def entry_points() -> set[str]:
    return {name for name in modules() if '__name__ == "__main__"' in (BENCH / f"{name}.py").read_text()}


def test_every_entry_point_is_run_somewhere():
    assert entry_points() == set(SMOKE) | set(RUN_ELSEWHERE) | set(PARSED_ONLY), (
        "an entry point of benchmarks/ needs a smoke run in SMOKE or the test that runs it in RUN_ELSEWHERE; "
        "a part needs no __main__ block"
    )
    for name, test in RUN_ELSEWHERE.items():
        assert name in (REPO / test).read_text(), f"{test} does not run benchmarks/{name}.py"


def _run_python(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_every_module_imports_and_every_entry_point_parses_its_arguments():
    """One process (the imports are shared): each module imported by its bare name as the entry points
    import their parts, then each entry point's ``--help`` run as ``python benchmarks/NAME.py --help`` runs."""
    code = textwrap.dedent(
        f"""
        import contextlib, importlib, io, runpy, sys, traceback
        sys.path.insert(0, {str(BENCH)!r})
        bad = []
        for name in {modules()!r}:
            try:
                importlib.import_module(name)
            except BaseException:
                bad.append(name + ": " + traceback.format_exc(limit=-2))
        for name in {sorted(entry_points())!r}:
            sys.argv = [name + ".py", "--help"]
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    runpy.run_path({str(BENCH)!r} + "/" + name + ".py", run_name="__main__")
                bad.append(name + " --help: returned without exiting")
            except SystemExit as e:
                if e.code not in (0, None) or "usage" not in out.getvalue():
                    bad.append(f"{{name}} --help: exit {{e.code}}: {{out.getvalue()[-300:]}}")
            except BaseException:
                bad.append(name + " --help: " + traceback.format_exc(limit=-2))
        print("\\n".join(bad))
        sys.exit(1 if bad else 0)
        """
    )
    proc = _run_python(code, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_the_tpu_benchmark_writes_a_shapes_checkpoint(tmp_path):
    """`tpu_bench.py checkpoint SHAPE DIR`: the checkpoint alone (serving.py --serve on the chip loads it)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "tpu_bench.py"), "checkpoint", "tiny", str(tmp_path)],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_entry_point_runs(name, tiny_checkpoint, tmp_path):
    model, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    argv, expect = SMOKE[name]
    argv = [a.format(model=model) for a in argv]
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *argv],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert expect in out, out[-4000:]
