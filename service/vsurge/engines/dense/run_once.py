"""vEngine's programs that only a prefix can feed: `insert` from each prefill shape (and from a chunked
prefill's row made a prefix), and the first-token samplers, each with abstract arguments.

Their arguments are the shapes of what a prefill returns (traced, not run), so they can be lowered and
compiled in the same parallel pool as the prefill and decode programs (`dense/warmup.compile_engine`),
instead of one after another when warm-up first runs them; and `program_inventory` lowers the same list
for a TPU target.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...structured.bitmask import bitmask_words
from ..example_args import GREEDY, abstract, sds
from ..sampling import make_slot_sampling

__all__ = ["Prefixes", "run_once_jobs"]


class Prefixes:
    """The prefix each prefill program returns, as abstract arrays where the engine keeps prefixes
    (`get_prefix_destination_sharding`); each traced once, on first use. ``prefill``: name -> (program,
    its example arguments, or a callable making them)."""

    def __init__(self, engine: Any, prefill: dict[str, tuple[Any, Any]]):
        self.engine, self.prefill = engine, prefill

    @functools.cache  # noqa: B019 - one Prefixes per listing, dropped with it
    def __call__(self, name: str) -> Any:
        fn, args = self.prefill[name]
        shapes = fn.eval_shape(*(args() if callable(args) else args))
        where = self.engine.get_prefix_destination_sharding()
        if isinstance(where, jax.sharding.Sharding):
            return abstract(shapes, where)
        return jax.tree.map(lambda x, sh: sds(x.shape, x.dtype, sh), shapes, where)


def long_prefix_args(engine: Any) -> tuple:
    """A chunked prefill's row and last hidden state as the chunk program hands them on (where it leaves
    them is the compiler's choice: here replicated on the engine's devices), for `_long_prefix`."""
    m, c, rep = engine.max_concurrent_prefill, engine.chunked, engine._replicated()
    sampling = make_slot_sampling([GREEDY] + [None] * (m - 1), stop_ids=[[]] * m)
    row = abstract(jax.eval_shape(c._zeros), rep)
    last = sds((engine.model_config.hidden_size,), engine.model.dtype, rep)
    words = np.zeros((m, bitmask_words(engine.model_config.vocab_size)), np.int32)
    return (row, last, words, np.int32(1), sampling)


def run_once_jobs(engine: Any, state: Any, prefixes: Prefixes) -> list[tuple[str, Any, Callable[[], tuple]]]:
    """(name, program, a callable making its abstract arguments) of: `insert` from every prefix
    ``prefixes`` knows, then the first-token samplers on the first one's entries. Arguments typed as
    the engine passes them (host int32 scalars, a u32[2] key), so the compiled programs are the ones
    live calls hit."""
    key, j = np.zeros(2, np.uint32), np.int32(0)
    m = engine.max_concurrent_prefill
    jobs = [
        (f"insert from {name}", engine._insert, lambda name=name: (prefixes(name), state, j, j, key, j))
        for name in prefixes.prefill
    ]
    first = next(iter(prefixes.prefill))

    def entries(*rest: Any) -> Callable[[], tuple]:
        def make() -> tuple:
            p = prefixes(first)
            return (engine.params, p.hidden, p.sampling, p.prompt_mask, *rest)

        return make

    jobs.append(("first token", engine._first, entries(j, key)))
    jobs.append(("first tokens", engine._firsts, entries(np.zeros(m, np.int32), np.zeros((m, 2), np.uint32))))
    return jobs
