"""oEngine's programs as (name, jitted program, example arguments): what its compile() lowers and compiles
in parallel, and what engines/program_inventory.py hands to a lowering for TPU (the same list, on
abstract arguments)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np


def step_metas(engine: Any) -> dict[tuple[int, int], np.ndarray]:
    """An all-idle metadata block per (rows, chunk tokens) mixed-step program (every page row scratch)."""
    return {rp: np.zeros(engine._layout(*rp).size, np.int32) for rp in engine._mixed}


def program_jobs(
    engine: Any, state: Any, inputs: Any, table: Any, place: Callable[[tuple, Any], Any]
) -> list[tuple[str, Any, tuple]]:
    """Every program of ``engine`` (an oEngine) a live request can hit, on ``state``, a sequence's
    ``inputs`` (SeqInputs) and the page ``table``; ``place(shape, dtype)`` makes a device argument (zeros
    on the device to compile, a jax.ShapeDtypeStruct to lower). The per-sequence prefill and decode
    programs only with ``legacy_programs``."""
    row, zero, v = np.zeros(engine.table_width, np.int32), np.int32(0), engine.config.vocab_size
    legacy = engine.legacy_programs
    jobs = [
        (
            f"prefill chunk {t} x {n} pages",
            engine._prefill[n],
            (engine.params, state.pages, np.ones(t, np.int32), zero, np.int32(t), row),
        )
        for t, n in (engine.prefill_shapes() if legacy else [])
    ]
    jobs.append(("seat", engine._seat, (state, place((v,), jnp.float32), zero, zero, inputs)))
    jobs += [
        (
            f"decode slots={r} x {n} pages",
            fn,
            (engine.params, state.pages, state.tokens, state.positions, table),
        )
        for (r, n), fn in (engine._forward.items() if legacy else [])
    ]
    metas = step_metas(engine)
    jobs += [
        (
            f"step rows={r} + {p} chunk tokens",
            fn,
            (engine.params, state.pages, state.tokens, state.positions, table, metas[(r, p)]),
        )
        for (r, p), fn in engine._mixed.items()
    ]
    k_logits = place((engine.step_seqs, v), jnp.float32)
    jobs.append(("seat after a chunk", engine._seat_chunk, (state, k_logits, zero, zero, zero, inputs)))
    jobs += [
        (f"sampler slots={r}", fn, (state, place((r, v), jnp.float32))) for r, fn in engine._sample.items()
    ]
    return jobs + engine.chunked.jobs()
