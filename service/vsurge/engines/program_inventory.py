"""An engine's programs, each as (name, jitted program, abstract arguments): everything a live request can
hit, from the same job lists the engine's compile() compiles, on arguments that hold no data.

The arguments are ``jax.ShapeDtypeStruct`` with the shardings the engine keeps its arrays in (the weights
by the partition rules, the decode state by the engine's state shardings); host inputs stay as the engine
passes them (numpy, uncommitted arrays: no sharding). So `programs` works on an engine whose weights are
abstract too (`models.loader.abstract_model`): built inside `tpu_lowering.targeting`, at any model size on
any machine, its programs lower as that TPU pod compiles them (tests/service/test_tpu_export.py).

vEngine: `dense/warmup.program_jobs` (what compile() compiles in parallel), then what compile() compiles
by running it once (insert from every prefill shape, a chunked prefill's prefix, the first-token
samplers) and `dense/warmup.structured_jobs` (what `warm_structured` adds). oEngine:
`paged/programs.program_jobs`, then `paged/structured_output.structured_jobs` (what its `warm_structured` adds).
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
from .dense.run_once import Prefixes, long_prefix_args, run_once_jobs
from .dense.vengine import GenerationState
from .dense.warmup import chained, structured_jobs
from .dense.warmup import program_jobs as dense_jobs
from .example_args import GREEDY, abstract, sds
from .paged.oengine import PagedEngine, PagedState
from .paged.programs import program_jobs as paged_jobs
from .paged.programs import sampler_rows
from .paged.structured_output import structured_jobs as paged_structured_jobs
from .sampling import DEFAULT_MAX_STOP_IDS, make_slot_sampling

__all__ = ["Program", "abstract", "programs", "state_spec"]


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
    s, v = engine.max_concurrent_decodes, engine.model_config.vocab_size
    rep = engine._replicated()
    rows = make_slot_sampling([None] * s, max_stop_ids=DEFAULT_MAX_STOP_IDS)
    fields = dict(
        tokens=sds((s,), np.int32, rep),
        positions=sds((s,), np.int32, rep),
        steps=sds((s,), np.int32, rep),
        counts=sds((s, v), np.int32, rep),
        prompt_mask=sds((s, v), np.bool_, rep),
        sampling=abstract(rows, rep),
    )
    if isinstance(engine, PagedEngine):
        storage = engine.storage
        pages = jax.tree.map(lambda sh: sds(storage.page_shape, storage.dtype, sh), storage.layer_shardings())
        return PagedState(pages=pages, **fields)
    kv = sds(
        engine._cache_shape(), engine.cache_dtype, engine._kv_sharding() if engine.mesh is not None else rep
    )
    return GenerationState(caches=tuple((kv, kv) for _ in range(engine.model_config.num_layers)), **fields)


def _dense_programs(engine: Any, state: Any) -> list[Program]:
    """vEngine's: compile()'s parallel jobs; the programs compile() compiles by running them (`insert`
    from each prefill shape and from a chunked prefill's row made a prefix, `sample_first`,
    `sample_firsts`); those `warm_structured` adds."""
    out = [Program(name, fn, _given(args)) for name, fn, args in dense_jobs(engine, state)]
    prefill = {p.name: (p.fn, lambda p=p: p.args) for p in out if p.fn is engine._prefill}
    # each prefill as its chain's programs (embed, layer, finish), on the prefill's abstract arguments
    listed = [(p.name, p.fn, lambda p=p: p.args) for p in out]
    out = [Program(name, fn, make) for name, fn, make in chained(engine, listed, made=False)]
    long = Program("chunked prefill's prefix", engine._long_prefix, _given(long_prefix_args(engine)))
    prefill["a chunked prefill"] = (long.fn, lambda: long.args)
    out.append(long)
    prefix = Prefixes(engine, prefill)
    out += [Program(name, fn, make) for name, fn, make in run_once_jobs(engine, state, prefix)]
    first = next(iter(prefill))
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
    if not isinstance(engine, PagedEngine):
        return _dense_programs(engine, state)
    rep = engine._replicated()
    inputs = abstract(engine.seq_inputs(GREEDY, [], np.zeros(2, np.uint32), [0]))
    table = sds((engine.max_concurrent_decodes, engine.table_width), np.int32, rep)
    jobs = paged_jobs(engine, state, inputs, table, lambda shape, dtype: sds(shape, dtype, rep))
    v = engine.model_config.vocab_size
    dec = [sds((r, v), np.float32, rep) for r in engine.step_rows]
    jobs += paged_structured_jobs(
        engine, sampler_rows(state), dec, [sds((engine.step_seqs, v), np.float32, rep)], inputs
    )
    return [Program(name, fn, _given(args)) for name, fn, args in jobs]
