"""engines/compile_watch.py: what a stretch of start-up compiled, from any thread, with watches that overlap
(two engines of one process compile at once: a multi-host leader and its worker over an in-process lane);
and vsurge/models/compiled/cache_reads.py: the persistent cache's reads take turns."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from vsurge.engines.compile_watch import compiled_during


def _compile_new(n: int) -> None:
    jax.jit(lambda x: jnp.sin(x) * n).lower(np.zeros(n, np.float32)).compile()


def test_overlapping_watches_each_see_their_compiles_and_end_apart():
    with compiled_during() as outer:
        with compiled_during() as inner:  # both empty, so equal: each must still end as itself
            pass
        assert inner == []
        _compile_new(3)
        with compiled_during() as other:
            pass
    assert len(outer) == 1 and outer[0][1] >= 0.0
    assert other == []


def test_a_compile_on_another_thread_counts():
    with compiled_during() as seen:
        t = threading.Thread(target=_compile_new, args=(5,))
        t.start()
        t.join()
    assert len(seen) == 1


def test_persistent_cache_reads_take_turns():
    # vsurge/models/compiled/cache_reads.py: XLA:CPU crashed deserializing two cached executables at once on two threads
    # of a compile pool; after compile_jobs installs the guard, a read waits while another holds the lock
    from jax._src import compilation_cache as cache
    from jax._src import xla_bridge

    from vsurge.engines.engine_base import compile_jobs
    from vsurge.models.compiled import cache_reads

    compile_jobs([("sin", jax.jit(jnp.sin), (np.zeros(7, np.float32),))], lambda _: None)
    assert getattr(cache.get_executable_and_time, "vsurge_serialized", False)
    done = threading.Event()

    def read():
        cache.get_executable_and_time("no-such-entry", None, xla_bridge.get_backend(), None)
        done.set()

    with cache_reads._lock:
        t = threading.Thread(target=read)
        t.start()
        assert not done.wait(0.3)  # held off while another read holds the lock
    assert done.wait(10)
    t.join()
