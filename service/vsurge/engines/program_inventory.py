"""An engine's programs, each as (name, jitted program, abstract arguments): everything a live request can
hit, from the same job lists the engine's compile() compiles, on arguments that hold no data.

The arguments are ``jax.ShapeDtypeStruct`` with the shardings the engine keeps its arrays in (the weights
by the partition rules, the decode state by the engine's state shardings); host inputs stay as the engine
passes them (numpy, uncommitted arrays: no sharding). So `programs` works on an engine whose weights are
abstract too (`models.loader.abstract_model`): built inside `tpu_lowering.targeting`, at any model size on
any machine, its programs lower as that TPU pod compiles them (tests/service/test_tpu_export.py).

vEngine: `dense_warmup.program_jobs` (what compile() compiles in parallel), then what compile() compiles
by running it once (insert from every prefill shape, a chunked prefill's prefix, the first-token
samplers) and `dense_warmup.structured_jobs` (what `warm_structured` adds). oEngine:
`paged_programs.program_jobs`, then `paged_structured.structured_jobs` (what its `warm_structured` adds).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..models.tpu_lowering import on_target
from .dense_warmup import GREEDY, structured_jobs
from .dense_warmup import program_jobs as dense_jobs
from .oengine import PagedState, oEngine
from .paged_programs import program_jobs as paged_jobs
from .paged_programs import sampler_rows
from .paged_structured import structured_jobs as paged_structured_jobs
from .sampling import DEFAULT_MAX_STOP_IDS, make_slot_sampling
from .vengine import GenerationState

__all__ = ["Program", "abstract", "programs", "state_spec"]


def _sds(shape: tuple, dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract(tree: Any, sharding: Any = None) -> Any:
    """Every array of ``tree`` as a jax.ShapeDtypeStruct: arrays committed to devices keep their sharding;
    host arrays and uncommitted ones (which jit places where the program wants them) get ``sharding``
    (default none: as the engine passes them)."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x if x.sharding is not None or sharding is None else _sds(x.shape, x.dtype, sharding)
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            own = x.sharding if isinstance(x, jax.Array) and x.committed else None
            return _sds(np.shape(x), x.dtype, own if own is not None else sharding)
        return x

    return jax.tree.map(one, tree)


@dataclasses.dataclass
class Program:
    """One program: its name (as compile() logs it), the jitted function, and its abstract arguments,
    built on first use (the shapes of a prefix cost a trace of the prefill that makes it)."""

    name: str
    fn: Any
    make_args: Callable[[], tuple] = dataclasses.field(repr=False)

    @functools.cached_property
    def args(self) -> tuple:
        """Inside `tpu_lowering.targeting`, on the target's mesh (as `lower_for_tpu` puts them): a prefix
        traced for its shapes then shares the trace of its prefill's export."""
        args = abstract(self.make_args())
        target = jax.sharding.get_abstract_mesh()
        return on_target(args, target) if target.abstract_device is not None else args


def _given(args: tuple) -> Callable[[], tuple]:
    return lambda: args


def state_spec(engine: Any) -> Any:
    """The engine's decode state (what ``init_decode_state`` returns) as abstract arrays, in the
    shardings the engine keeps it: the KV cache as the engine lays it out, every other row replicated."""
    s, v = engine.max_concurrent_decodes, engine.config.vocab_size
    rep = engine._replicated()
    rows = make_slot_sampling([None] * s, max_stop_ids=DEFAULT_MAX_STOP_IDS)
    fields = dict(
        tokens=_sds((s,), np.int32, rep),
        positions=_sds((s,), np.int32, rep),
        steps=_sds((s,), np.int32, rep),
        counts=_sds((s, v), np.int32, rep),
        prompt_mask=_sds((s, v), np.bool_, rep),
        sampling=abstract(rows, rep),
    )
    if isinstance(engine, oEngine):
        storage = engine.storage
        pages = jax.tree.map(
            lambda sh: _sds(storage.page_shape, storage.dtype, sh), storage.layer_shardings()
        )
        return PagedState(pages=pages, **fields)
    kv = _sds(
        engine._cache_shape(), engine.cache_dtype, engine._kv_sharding() if engine.mesh is not None else rep
    )
    return GenerationState(caches=tuple((kv, kv) for _ in range(engine.config.num_layers)), **fields)


def _dense_programs(engine: Any, state: Any) -> list[Program]:
    """vEngine's: compile()'s parallel jobs; the programs compile() compiles by running them (`insert`
    from each prefill shape and from a chunked prefill's row made a prefix, `sample_first`,
    `sample_firsts`); those `warm_structured` adds."""
    out = [Program(name, fn, _given(args)) for name, fn, args in dense_jobs(engine, state)]
    prefill = {p.name: p for p in out if p.fn is engine._prefill}
    key, j = np.zeros(2, np.uint32), np.int32(0)
    m, c, rep = engine.max_concurrent_prefill, engine.chunked, engine._replicated()
    sampling = make_slot_sampling([GREEDY] + [None] * (m - 1), stop_ids=[[]] * m)
    # a chunked prefill's row and last hidden state, as the chunk program hands them on (where it leaves
    # them is the compiler's choice: here replicated on the engine's devices)
    row = abstract(jax.eval_shape(c._zeros), rep)
    last = _sds((engine.config.hidden_size,), engine.model.dtype, rep)
    long_args = (row, last, np.zeros(c.row_length, np.int32), np.int32(1), sampling)
    prefill["a chunked prefill"] = Program("chunked prefill's prefix", engine._long_prefix, _given(long_args))
    where = engine.get_prefix_destination_sharding()

    @functools.cache
    def prefix(name: str) -> Any:  # what that program returns (traced, not run), where a prefix lives
        shapes = prefill[name].fn.eval_shape(*prefill[name].args)
        if isinstance(where, jax.sharding.Sharding):
            return abstract(shapes, where)
        return jax.tree.map(lambda x, sh: _sds(x.shape, x.dtype, sh), shapes, where)

    out.append(prefill["a chunked prefill"])
    out += [
        Program(f"insert from {name}", engine._insert, lambda name=name: (prefix(name), state, j, j, key, j))
        for name in prefill
    ]
    # the entries of every prefix have the same shapes ([K, ...]): the first prefill's serve the samplers
    first = next(iter(prefill))

    def entries(*rest: Any) -> Callable[[], tuple]:
        def make() -> tuple:
            p = prefix(first)
            return (engine.params, p.hidden, p.sampling, p.prompt_mask, *rest)

        return make

    out.append(Program("first token", engine._first, entries(j, key)))
    out.append(
        Program("first tokens", engine._firsts, entries(np.zeros(m, np.int32), np.zeros((m, 2), np.uint32)))
    )
    # warm_structured's, their arguments on that prefix too (listed without it: names and programs only)
    unset = types.SimpleNamespace(hidden=None, sampling=None, prompt_mask=None)
    out += [
        Program(name, fn, lambda i=i: structured_jobs(engine, state, prefix(first))[i][2])
        for i, (name, fn, _) in enumerate(structured_jobs(engine, state, unset))
    ]
    return out


def programs(engine: Any) -> list[Program]:
    """Every program of ``engine`` (a vEngine or an oEngine) a live request can hit, compile()'s first,
    as `Program` (name, jitted function, abstract arguments), then the structured-output programs.
    Nothing is allocated but small host inputs, nothing compiled or traced until a program's ``args``
    are read; read them inside `tpu_lowering.targeting` to lower for that TPU."""
    state = state_spec(engine)
    if not isinstance(engine, oEngine):
        return _dense_programs(engine, state)
    rep = engine._replicated()
    inputs = abstract(engine.seq_inputs(GREEDY, [], np.zeros(2, np.uint32), [0]))
    table = _sds((engine.max_concurrent_decodes, engine.table_width), np.int32, rep)
    jobs = paged_jobs(engine, state, inputs, table, lambda shape, dtype: _sds(shape, dtype, rep))
    v = engine.config.vocab_size
    dec = [_sds((r, v), np.float32, rep) for r in engine.step_rows]
    jobs += paged_structured_jobs(
        engine, sampler_rows(state), dec, [_sds((engine.step_seqs, v), np.float32, rep)], inputs
    )
    return [Program(name, fn, _given(args)) for name, fn, args in jobs]
