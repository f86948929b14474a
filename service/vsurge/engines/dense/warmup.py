"""vEngine's warm-up: compile every program a live request can hit, before the first one arrives.

`compile_engine` lowers and compiles the prefill buckets and row packs (each a chain of three programs:
layered_prefill.py), the decode step per row bucket,
chunked prefill, slot moves, verify and mixed steps in parallel threads (XLA compiles without the GIL),
then runs each once on the real state so the jit caches hold exactly the live signatures.
`warm_structured` adds what structured output needs, later and on its own thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...models.compiled.executable_store import store_for
from ..compile_watch import compiled_during
from ..engine_base import compile_jobs
from ..example_args import GREEDY, spec_of, zeros_of
from ..sampling import SampleResult
from .run_once import Prefixes, long_prefix_args, run_once_jobs
from .slot_moves import move_args

log = logging.getLogger(__name__)


def _warm_prompts(engine: Any) -> tuple[dict[int, list[int]], dict[int, list[list[int]]]]:
    """A prompt filling each prefill bucket; per multi-row pack, as many prompts as rows, each filling its
    row. A bucket of max_length holds at most max_length - 1 prompt tokens (one is generated)."""
    warm = {n: [1] * min(n, engine.max_prompt_length) for n in engine.prefill_lengths}
    width = min(engine.prefill_pack_tokens, engine.max_prompt_length)
    return warm, {r: [[1] * width] * r for r in engine.pack_rows}


def _single_steps(engine: Any) -> dict[int, Any]:
    """The single decode step per row bucket, where the driver runs one: with decode blocks it never
    does (blocks, or the structured split step), so those are compiled only if called directly."""
    return {} if engine.blocks is not None else engine._decode


def program_jobs(engine: Any, state: Any) -> list[tuple[str, Any, tuple]]:
    """(name, program, example arguments) of every program `compile_engine` lowers and compiles in
    parallel, on ``state``: the real decode state, or its abstract twin (engines/program_inventory.py)."""
    greedy = [GREEDY]
    warm, warm_rows = _warm_prompts(engine)
    jobs = [
        (
            f"prefill bucket {n}",
            engine._prefill,
            (engine.prefill_params, *engine._pack([warm[n]], greedy, None)),
        )
        for n in engine.prefill_lengths
    ]
    width = engine.prefill_pack_tokens
    jobs += [
        (
            f"prefill rows {r}x{width}",
            engine._prefill,
            (engine.prefill_params, *engine._pack(prompts, greedy * r, None)),
        )
        for r, prompts in warm_rows.items()
    ]
    jobs += [
        (f"decode slots={r}", fn, (engine.step_params(r), state, np.ones(r, np.int32)))
        for r, fn in _single_steps(engine).items()
    ]
    jobs += engine.chunked.jobs()
    jobs.append(("move slots", engine._move, (state, *move_args([], engine.max_concurrent_decodes))))
    if engine.blocks is not None:
        jobs += engine.blocks.jobs(state)
    if engine.speculator is not None:
        jobs += engine.speculator.jobs(state)
    if engine.mixed is not None:
        jobs += engine.mixed.jobs(state)
    return jobs


def longest_first(engine: Any, jobs: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """``jobs`` with the slowest to build first (a stable sort): the steps that hold the whole model and
    the sampler (decode blocks and steps, verify, mixed), then the first-token samplers, then the rest.
    The pool has a thread per core and the jobs outnumber them: listed last, the decode blocks started
    after the prefill chains and ended the start (a v5e, the 1B shape: 26-33 s of a 43.5 s cold start,
    ~9.5 s of a 12.5 s warm one, each alone ~20 s cold)."""
    steps = [*engine._decode.values(), *engine._forward.values()]
    steps += [*engine.blocks.programs.values()] if engine.blocks is not None else []
    steps += [*engine.speculator._fns.values()] if engine.speculator is not None else []
    steps += [*engine.mixed._fns.values()] if engine.mixed is not None else []
    samplers = [engine._first, engine._firsts]

    def rank(job: tuple[str, Any, Any]) -> int:
        fn = job[1]
        return 0 if any(fn is f for f in steps) else 1 if any(fn is f for f in samplers) else 2

    return sorted(jobs, key=rank)


def chained(engine: Any, jobs: list[tuple[str, Any, Any]], made: bool = True) -> list[tuple[str, Any, Any]]:
    """``jobs`` with each prefill entry (name, `engine._prefill`, its arguments) as the programs of its
    chain (layered_prefill.py): embed, layer, finish. ``made``: their arguments made (as `compile_jobs`
    takes them); else callables making them (as `program_inventory` lists them)."""
    out = []
    for name, fn, args in jobs:
        if fn is not engine._prefill:
            out.append((name, fn, args))
            continue
        parent = args if callable(args) else (lambda args=args: args)
        out += [(n, f, make() if made else make) for n, f, make in fn.jobs(name, parent)]
    return out


def structured_jobs(engine: Any, state: Any, prefix: Any) -> list[tuple[str, Any, tuple]]:
    """What `warm_structured` compiles: the split step (model, then the masked sampler) per row count
    and the masked first token, on ``state`` and a ``prefix`` (real arrays or their shapes)."""
    v = engine.model_config.vocab_size
    mask_spec = partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    words = -(-v // 32)
    jobs = [
        (f"forward slots={r}", fn, (engine.step_params(r), state, np.ones(r, np.int32)))
        for r, fn in engine._forward.items()
    ]
    jobs += [
        (
            f"masked sampler slots={r}",
            fn,
            (state, jax.ShapeDtypeStruct((r, v), jnp.float32), mask_spec((r, words))),
        )
        for r, fn in engine._sample_masked.items()
    ]
    key = np.zeros(2, np.uint32)
    first_args = (engine.params, prefix.hidden, prefix.sampling, prefix.prompt_mask, np.int32(0), key)
    jobs.append(("masked first token", engine._first, (*first_args, mask_spec((1, words)))))
    return jobs


def compile_engine(engine: Any, progress: Callable[[str], None] | None = None) -> float:
    """Compile every program a live request can hit; returns seconds.

    Every program is lowered and compiled in parallel threads (XLA compiles without the GIL), those a
    prefix feeds (insert, the first-token samplers) on the prefixes' shapes; then each runs once on the
    real state, so the jit caches hold exactly the signatures live requests use (what still compiled
    after the pool, one program at a time, is named in ``engine.compile_report['after_pool']``).
    """
    say = progress or log.info
    t0 = time.perf_counter()
    state = engine.init_decode_state()
    jobs = program_jobs(engine, state)
    prefill = {name: (fn, args) for name, fn, args in jobs if fn is engine._prefill}
    prefill["a chunked prefill"] = (engine._long_prefix, lambda: long_prefix_args(engine))
    # the chain's arguments are made by compile_jobs, and only for programs the store does not hold (each
    # traces the programs before it)
    jobs = chained(engine, jobs, made=False)
    jobs.append(("chunked prefill's prefix", *prefill["a chunked prefill"]))
    if jax.default_backend() != "cpu":
        # XLA:CPU segfaulted deserializing these programs from the persistent cache once compiled this way
        # (tests/service/test_dense_mixed.py, 3 runs of 3; 0 of 1 without them in the pool); on TPU they
        # compiled, ran and were read back from the cache (2026-12-06). On CPU they compile on first run.
        jobs += run_once_jobs(engine, state, Prefixes(engine, prefill))
    store = store_for(engine)
    with compiled_during() as in_pool:
        times = compile_jobs(longest_first(engine, jobs), say, store)
    pool_s = time.perf_counter() - t0
    with compiled_during() as after_pool:
        state = _run_each_once(engine, state, say)
        # shapes for warm_structured, which may run later on another thread
        engine._specs = jax.tree.map(spec_of, (state, engine.prefill([1], GREEDY)))
        engine.free_resource(0)
        del state
    engine.compiled = True
    engine.executable_store = store
    if store is not None:
        store.finish()  # the executables compiled here are written on the store's thread
    total = time.perf_counter() - t0
    engine.compile_report = dict(
        programs=len(jobs),
        pool_s=round(pool_s, 2),
        pool=sorted({name for name, _ in in_pool}),
        slowest=sorted(times, key=lambda x: -x[1])[:8],  # lowering and compiling, per job
        total_s=round(total, 2),
        after_pool=sorted(after_pool, key=lambda x: -x[1]),
        executables=None if store is None else store.report(),
    )
    say(
        f"compiled {len(jobs)} programs in {total:.1f}s ({pool_s:.1f}s in parallel; {len(after_pool)} "
        f"compiled after, {sum(x[1] for x in after_pool):.1f}s)"
    )
    return total


def _run_each_once(engine: Any, state: Any, say: Callable[[str], None]) -> Any:
    """Every program on the real state once, as live requests call it; returns the state."""
    greedy = [GREEDY]
    warm, warm_rows = _warm_prompts(engine)
    for n in engine.prefill_lengths:
        state, first = engine.insert(engine.prefill(warm[n], greedy[0]), state, 0)
    for r, prompts in warm_rows.items():
        state, first = engine.insert(engine.prefill_many(prompts, greedy * r), state, 0, index=r - 1)
    # a driver's early first tokens (sample_firsts, read to the host), then the insert that takes one
    prefix = engine.prefill(warm[engine.prefill_lengths[0]], greedy[0])
    host = [np.asarray(x) for x in engine.sample_firsts(prefix, [0], engine.entry_keys(prefix)[:1])]
    state, first = engine.insert(prefix, state, 0, first=SampleResult(*(x[:1] for x in host)))
    # a chunked prefill through every bucket, with prompt logprobs, then its (longer) row's insert
    engine.warm_chunked()
    state, first = engine.insert(
        engine.prefill_chunked([1] * engine.max_prompt_length, greedy[0])[0], state, 0
    )
    out = None
    for r, fn in _single_steps(engine).items():
        state, out = fn(engine.step_params(r), state, np.ones(r, np.int32))
    state = engine._move(state, *move_args([(0, 0)], engine.max_concurrent_decodes))
    jax.block_until_ready((state, out))
    if engine.blocks is not None:
        state = engine.blocks.warm(state)
    if engine.mixed is not None:
        state = engine.mixed.warm(state)
    if engine.speculator is not None:
        state = engine.speculator.warm(state)
        ratios = ", ".join(f"{r} rows {x:.2f}x" for r, x in engine.speculator.cost_ratio.items())
        say(f"verify step (k={engine.speculator.k}) / decode step: {ratios}")
    return state


def warm_structured(engine: Any, progress: Callable[[str], None] | None = None) -> float:
    """Compile what structured output adds: the split step (model, then the masked sampler) per row
    count and the masked first token. Not part of `compile`: only an engine that serves a constrained
    request pays for them, on a background thread (the driver holds constrained requests until this
    returns; other requests go on). Compiled from shapes and run once on a throwaway state, so it never
    touches the live one."""
    say = progress or log.info
    t0 = time.perf_counter()
    if engine._specs is not None:
        state, prefix = engine._specs
        v = engine.model_config.vocab_size
        words = -(-v // 32)
        key = np.zeros(2, np.uint32)
        jobs = structured_jobs(engine, state, prefix)
        store = store_for(engine)
        compile_jobs(jobs, say, store)
        if store is not None:
            store.finish(index=False)  # prefetched at a start: only what compile() needs before ready
        # one real call of each on a throwaway state: the jit dispatch caches then hold the live
        # signatures (tracing and lowering happen here, never on the step thread)
        dummy, pre = jax.tree.map(zeros_of, (state, prefix))
        for r in engine._forward:
            dummy, logits = engine._forward[r](engine.step_params(r), dummy, np.ones(r, np.int32))
            dummy, out = engine._sample_masked[r](dummy, logits, np.full((r, words), -1, np.int32))
        ones = np.full((1, words), -1, np.int32)
        first = engine._first(
            engine.params, pre.hidden, pre.sampling, pre.prompt_mask, np.int32(0), key, ones
        )
        jax.block_until_ready((out, first))
        del dummy, pre
    engine.structured_ready.set()
    say(f"compiled the structured-output programs in {time.perf_counter() - t0:.1f}s")
    return time.perf_counter() - t0
