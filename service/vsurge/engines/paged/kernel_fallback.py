"""oEngine's start on the TPU kernel path, with the pure-JAX path to fall back to: never a crash loop.

A Mosaic kernel can fail at start for reasons no CPU test sees: a block size or VMEM limit the chip's
compiler refuses, a jax whose kernel does not lower for these shapes. Where the failure is the kernel's,
the engine serves anyway, on the pure-JAX paged attention, and says why (a warning naming the error, and
`pallas_sharded.current().reason`, which the engine's status can show):

1. `check_kernel` lowers the mixed-step programs of both kernel shape classes (decode only, and with the
   most chunk tokens) from abstract arguments, before anything is allocated or compiled: a lowering
   error costs a second, not a whole compile;
2. `compile_with_fallback` runs the engine's compile and, should it still fail on the kernel path (an
   error only the compiler finds, e.g. VMEM), falls back and compiles once more.

Falling back (`fall_back`) keeps the page count (the page manager, and the driver's scheduler that holds
it, stay valid; the JAX layout never costs more bytes per page) and rebuilds the programs over the JAX
layout. A failure on the pure-JAX path is raised as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...models.pallas_sharded import current as current_attention
from ...models.pallas_sharded import demote as demote_attention
from ..example_args import sds

log = logging.getLogger(__name__)


def _reason(error: BaseException) -> str:
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def fall_back(engine: Any, error: BaseException) -> str:
    """Put ``engine`` (an oEngine) on the pure-JAX path after its kernel failed; returns the reason."""
    reason = _reason(error)
    demote_attention(reason)
    engine._spare = None  # the kernel layout's state, if compile() got that far
    engine.storage = engine.storage.for_jax_path()
    engine._make_programs()
    return reason


def abstract_step_args(engine: Any, rows: int, tokens: int) -> tuple:
    """Arguments of the engine's (rows, tokens) mixed-step program with the shapes and shardings of the
    real ones, nothing allocated (the weights are the engine's own): to lower it, here or for a TPU
    (models/tpu_lowering.py)."""
    storage, rep = engine.storage, engine._replicated()

    pages = jax.tree.map(lambda sh: sds(storage.page_shape, storage.dtype, sh), storage.layer_shardings())
    s = engine.max_concurrent_decodes
    return (
        engine.params,
        pages,
        sds((s,), np.int32, rep),
        sds((s,), np.int32, rep),
        sds((s, engine.table_width), np.int32, rep),
        np.zeros(engine._layout(rows, tokens).size, np.int32),
    )


def check_kernel(engine: Any) -> str | None:
    """Lower the kernel's mixed-step programs (no allocation, no compile); on failure fall back to pure
    JAX. Returns the reason it fell back (None: the kernel lowers, or is not the configured path)."""
    if not current_attention().pallas:
        return None
    rows = engine.step_rows[0]
    try:
        for tokens in sorted({engine.step_tokens[0], engine.step_tokens[-1]}):
            engine._mixed[(rows, tokens)].lower(*abstract_step_args(engine, rows, tokens))
    except Exception as e:  # noqa: BLE001 - whatever the kernel raised, the JAX path may still serve
        return fall_back(engine, e)
    return None


def compile_with_fallback(engine: Any, compile_fn: Callable[[], Any]) -> float:
    """``compile_fn`` (the engine's compile) after `check_kernel`; once more on the JAX path if it fails
    on the kernel path. Returns the seconds of it all (a failed attempt is part of the start)."""
    t0 = time.perf_counter()
    check_kernel(engine)
    try:
        compile_fn()
    except Exception as e:  # noqa: BLE001 - see check_kernel
        if not current_attention().pallas:
            raise
        fall_back(engine, e)
    else:
        return time.perf_counter() - t0
    # outside the handler: the failed attempt's state (its pages) is released before the second one
    compile_fn()
    return time.perf_counter() - t0
