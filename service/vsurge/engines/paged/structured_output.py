"""oEngine's structured output: the masked sampler per row count and the masked seat after a final chunk.

A step with a constrained row runs in two halves (`oEngine.step_logits`, then `oEngine.step_sample`): the
mixed forward, the same program as every step, is dispatched first; the host fills the token masks while
the device runs it (drivers/paged/grammars.py); then the samplers run under the masks. Unconstrained rows
carry all-ones mask rows (their samples are bit for bit the unmasked ones), and a step without a
constrained row runs the unmasked samplers, unchanged.

Both masked programs take the decode state without its pages (`SamplerRows`): a sampler never reads the
KV cache, so `warm_structured` can run them once on a throwaway state without allocating a second cache.
They are not part of compile(): `warm_structured` compiles them on a background thread the first time a
constrained request arrives (the driver holds constrained requests until it returns; the others go on),
from the shapes and shardings compile() saw (`StructuredSpecs`), so no live request ever compiles.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np

from ...structured.bitmask import ALL_ALLOWED, bitmask_words
from ..engine_base import compile_jobs, sample_step
from ..example_args import GREEDY, spec_of, zeros_of
from .mixed_step import seat_chunk
from .programs import SamplerRows, sampler_rows
from .seat import seat

log = logging.getLogger(__name__)


def masked_programs(engine: Any) -> tuple[dict[int, Any], Any]:
    """(masked sampler per row count, masked seat after a chunk), jitted over `SamplerRows` (donated)."""
    shardings = engine._state_shardings
    rows_shardings = None if shardings is None else SamplerRows(*shardings[1:])
    top = engine.num_top_logprobs
    samplers = {
        rows: jax.jit(
            partial(sample_step, rows=rows, num_top=top, shardings=rows_shardings), donate_argnums=(0,)
        )
        for rows in engine.step_rows
    }
    masked_seat = partial(seat, num_top=top, shardings=rows_shardings)
    return samplers, jax.jit(partial(seat_chunk, seat=masked_seat), donate_argnums=(0,))


def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """A host mask of ``rows`` rows that allows every token (what an unconstrained row carries)."""
    return np.full((rows, bitmask_words(vocab_size)), ALL_ALLOWED, np.int32)


def structured_jobs(
    engine: Any, rows: Any, dec_logits: Sequence[Any], pf_logits: Sequence[Any], inputs: Any
) -> list[tuple[str, Any, tuple]]:
    """What `warm_structured` compiles, on ``rows`` (`SamplerRows`), the decode logits of each row count
    and the chunk logits (real arrays or their shapes) and a sequence's ``inputs`` (SeqInputs). The
    masks are host arrays, as the driver passes them."""
    v, zero = engine.model_config.vocab_size, np.int32(0)
    jobs = [
        (
            f"masked sampler slots={x.shape[0]}",
            engine._sample_masked[x.shape[0]],
            (rows, x, all_allowed(x.shape[0], v)),
        )
        for x in dec_logits
    ]
    jobs += [
        (
            "masked seat after a chunk",
            engine._seat_masked,
            (rows, x, zero, zero, zero, inputs, all_allowed(1, v)),
        )
        for x in pf_logits
    ]
    return jobs


class StructuredSpecs:
    """What the masked programs take, as compile() met it on the live state: the state's rows and each
    distinct (shape, sharding) of the decode and chunk logits the mixed forwards returned."""

    def __init__(self) -> None:
        self.rows: Any = None
        self.dec: dict[tuple, jax.ShapeDtypeStruct] = {}
        self.pf: dict[tuple, jax.ShapeDtypeStruct] = {}

    def saw(self, dec_logits: Any, pf_logits: Any) -> None:
        for seen, x in ((self.dec, dec_logits), (self.pf, pf_logits)):
            if x is not None:
                seen.setdefault((x.shape, x.sharding), spec_of(x))

    def state(self, state: Any) -> None:
        self.rows = jax.tree.map(spec_of, sampler_rows(state))


def warm_structured(engine: Any, progress: Callable[[str], None] | None = None) -> float:
    """Compile the masked programs from the shapes compile() saw, then run each once on a throwaway
    `SamplerRows` (the jit dispatch caches then hold the live signatures); never touches the live state.
    Before compile() (no shapes yet) it only marks the engine ready: the programs compile on first use."""
    say = progress or log.info
    t0 = time.perf_counter()
    specs: StructuredSpecs | None = engine._structured_specs
    if specs is not None and specs.rows is not None:
        v, zero = engine.model_config.vocab_size, np.int32(0)
        inputs = engine.seq_inputs(GREEDY, [], np.zeros(2, np.uint32), [0])
        dec, pf = list(specs.dec.values()), list(specs.pf.values())
        compile_jobs(structured_jobs(engine, specs.rows, dec, pf, inputs), say)
        dummy, outs = jax.tree.map(zeros_of, specs.rows), []
        for x in dec:
            r = x.shape[0]
            dummy, out = engine._sample_masked[r](dummy, zeros_of(x), all_allowed(r, v))
            outs.append(out)
        for x in pf:
            dummy, first = engine._seat_masked(
                dummy, zeros_of(x), zero, zero, zero, inputs, all_allowed(1, v)
            )
            outs.append(first)
        jax.block_until_ready(outs)
        del dummy
    engine.structured_ready.set()
    say(f"compiled the structured-output programs in {time.perf_counter() - t0:.1f}s")
    return time.perf_counter() - t0
