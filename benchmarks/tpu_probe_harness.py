# ruff: noqa: B023 - the probe's closures run inside the loop iteration that made them
"""tpu_probe's harness: the time budget, sections that record their result or error, timing of compiled
calls, and the model shapes the probes run at."""

from __future__ import annotations

import functools
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from device_check import SHAPES  # noqa: E402

RESULTS: dict[str, Any] = {"sections": {}, "errors": []}
DEADLINE = [float("inf")]


def left() -> float:
    return DEADLINE[0] - time.perf_counter()


def section(name: str, need: float = 5.0):
    """Run a section if `need` seconds are left; record its result or its error."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            if left() < need:
                print(f"## {name}: skipped (time budget, {left():.0f}s left)", flush=True)
                RESULTS["sections"][name] = "skipped"
                return None
            t0 = time.perf_counter()
            print(f"## {name}", flush=True)
            try:
                out = fn(*a, **kw)
                RESULTS["sections"][name] = out
                return out
            except Exception as e:  # noqa: BLE001 - every section stands alone
                msg = f"{name}: {type(e).__name__}: {str(e)[:400]}"
                print("ERROR", msg, flush=True)
                traceback.print_exc(limit=4)
                RESULTS["errors"].append(msg)
                return None
            finally:
                print(f"## {name} took {time.perf_counter() - t0:.1f}s", flush=True)

        return run

    return wrap


def timeit(fn, *args, n: int = 10, warm: int = 2) -> float:
    """Median seconds per call (block_until_ready each), after warm-up calls (compile included there)."""
    out = None
    for _ in range(warm):
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def timeit_compiled(fn, *args, n: int = 10) -> tuple[float, float]:
    t0 = time.perf_counter()
    c = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return compile_s, timeit(c, *args, n=n)


# --------------------------------------------------------------------------------------------- shapes

SHAPES = dict(SHAPES)
SHAPES["1b64"] = SHAPES["1b"]
SHAPES["1b128"] = replace(SHAPES["1b"], num_heads=16, head_dim=128)
TINY = replace(SHAPES["tiny"], head_dim=64, num_heads=4, num_kv_heads=2, hidden_size=256)
