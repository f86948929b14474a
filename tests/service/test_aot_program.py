"""AotProgram: calls run the executables handed to it, by the shapes of their arguments; anything else
(another signature, tracers, keywords) runs through the jit, and a live call that does is recorded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vsurge.engines.aot_program import AotProgram, missed, missed_since, shapes_of


def _scaled():
    """A new function each time: JAX shares a jit's caches between jit objects of one function."""

    def _scaled(x, y):
        return x * 2.0 + y.sum()

    return _scaled


def test_a_call_with_a_compiled_signature_runs_that_executable():
    p = AotProgram(_scaled())
    x, y = jnp.ones((4,)), jnp.ones((3,))
    p.use(p.lower(x, y).compile())
    before = p._cache_size()
    got = p(x, y)
    np.testing.assert_allclose(np.asarray(got), np.full(4, 5.0))
    # the jit never traced nor compiled anything: the executable ran
    assert p._cache_size() == before == 0
    assert p.executables == 1


def test_another_signature_runs_through_the_jit_and_is_recorded():
    p = AotProgram(_scaled())
    p.use(p.lower(jnp.ones((4,)), jnp.ones((3,))).compile())
    seen = missed()
    got = p(jnp.ones((5,)), jnp.ones((3,)))  # a shape nothing compiled
    np.testing.assert_allclose(np.asarray(got), np.full(5, 5.0))
    assert p._cache_size() == 1
    assert {n.rsplit(".", 1)[-1]: c for n, c in missed_since(seen).items()} == {"_scaled": 1}


def test_executables_are_found_by_their_argument_shapes():
    p = AotProgram(_scaled())
    for n in (2, 8):
        p.use(p.lower(jnp.ones((n,)), jnp.ones((3,))).compile())
    seen = missed()
    for n in (2, 8):
        np.testing.assert_allclose(np.asarray(p(jnp.ones((n,)), jnp.ones((3,)))), np.full(n, 5.0))
    assert p._cache_size() == 0 and missed_since(seen) == {}


def test_tracing_through_a_program_uses_the_jit_and_records_nothing():
    p = AotProgram(_scaled())
    p.use(p.lower(jnp.ones((4,)), jnp.ones((3,))).compile())
    seen = missed()
    out = jax.jit(lambda x, y: p(x, y) + 1.0)(jnp.ones((4,)), jnp.ones((3,)))
    np.testing.assert_allclose(np.asarray(out), np.full(4, 6.0))
    assert missed_since(seen) == {}


def test_donation_holds_through_the_executable():
    p = AotProgram(_scaled(), donate_argnums=(0,))
    x = jnp.ones((4,))
    p.use(p.lower(x, jnp.ones((3,))).compile())
    p(x, jnp.ones((3,)))
    if jax.default_backend() != "cpu":  # XLA:CPU ignores donation
        assert x.is_deleted()


def test_shapes_of_reads_arrays_scalars_and_arg_infos_alike():
    p = AotProgram(lambda a, b, c: a + b + c)
    args = (jnp.ones((2, 3)), np.int32(1), 2.0)
    compiled = p.lower(*args).compile()
    assert shapes_of(args) == shapes_of(compiled.args_info) == ((2, 3), (), ())
