"""engines/compile_watch.py: what a stretch of start-up compiled, from any thread, with watches that overlap
(two engines of one process compile at once: a multi-host leader and its worker over an in-process lane)."""

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
