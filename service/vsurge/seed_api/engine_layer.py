"""What both engines add for the seed's API: the attributes the seed reads, `prng_key` (a new key split
off on each access), the weights as `graphstate` / `graphothers`, and `seed_forms`, which lets a method
keep its name for both the seed's call form and the engine's own.

The engines' own steps (what the drivers run) keep their signatures; where the seed uses the same name
with other arguments (`vEngine.decode(graphstate, graphothers, state, rngs)` beside the driver's
`decode(decode_state)`), `seed_forms` wraps the method so that a call in the seed's form runs the seed
layer (dense.py, paged.py) and any other call runs the engine's method untouched.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

__all__ = ["SeedEngineLayer", "host_key", "seed_forms"]

# (args, kwargs) -> True when a call is in the seed's form
FormTest = Callable[[tuple, dict], bool]


class SeedEngineLayer:
    """Mixin of vEngine and oEngine (first in their bases, so its properties take effect)."""

    # Set by EngineBase._setup and _seed_setup as plain attributes; declared here because the seed's engines have them
    # (protocols.AbstractInferenceEngine reads declarations).
    batch_size: int | None  # the decode batch (max_concurrent_decodes), as the seed's batch_size sets it
    samples_per_slot: int
    prefill_lengths: list[int]
    max_concurrent_decodes: int
    max_concurrent_prefill: int
    max_prefill_length: int
    max_length: int

    # name -> (is this call the seed's form?, the seed layer's method): read by seed_forms
    _seed_forms: dict[str, tuple[FormTest, str]] = {}

    def _seed_setup(self) -> None:
        """The seed's attributes, once the core engine is built."""
        self.batch_size = self.max_concurrent_decodes  # the seed's batch size: the decode batch
        self.samples_per_slot = 1
        self.prng_key = jax.random.PRNGKey(self.engine_config.seed)

    @property
    def prng_key(self) -> jax.Array:
        """A new PRNG key on each access, split off the engine's key (seeded by ``seed``): the seed's."""
        self._prng_key, key = jax.random.split(self._prng_key)
        return key

    @prng_key.setter
    def prng_key(self, key: jax.Array) -> None:
        self._prng_key = key

    @property
    def graphstate(self) -> Any:
        """The model's weights as the engine holds them (placed on its mesh): what the seed's steps take."""
        return self.params

    @property
    def graphothers(self) -> nnx.State:
        """The model's other variables: none (every variable of our models is in ``graphstate``)."""
        return nnx.State({})

    def _check_weights(self, graphstate: Any, graphothers: Any) -> None:
        """The seed passes the weights to every step; ours are bound at construction, so only the
        engine's own are accepted (None too)."""
        own = graphstate is None or graphstate is self.params
        no_others = graphothers is None or not jax.tree_util.tree_leaves(graphothers)
        if not (own and no_others):
            raise ValueError(
                "this engine runs on the weights it was built with: pass engine.graphstate and "
                "engine.graphothers (build another engine for other weights)"
            )


def host_key(rngs: Any) -> np.ndarray:
    """A PRNG key (raw u32[2] or a typed key) as host key data u32[2], what the samplers take."""
    if hasattr(rngs, "dtype") and jax.dtypes.issubdtype(rngs.dtype, jax.dtypes.prng_key):
        rngs = jax.random.key_data(rngs)
    key = np.asarray(rngs, np.uint32).reshape(-1)
    if key.shape != (2,):
        raise ValueError(f"rngs must be one PRNG key (2 uint32 words), got shape {np.shape(rngs)}")
    return key


def seed_forms(cls: type) -> type:
    """Class decorator: for each ``name -> (test, seed method)`` of ``cls._seed_forms``, ``cls.name`` runs
    the seed method when ``test(args, kwargs)`` says the call is in the seed's form, else the class's own
    method. The signature shown is the seed's (the one the seed documents); the engine's own form is in
    the docstring and at ``.engine_method``."""
    for name, (test, seed_name) in cls._seed_forms.items():
        own = getattr(cls, name)  # the core engine's method (cls is the seed's subclass of it)
        seed = getattr(cls, seed_name)
        setattr(cls, name, _dispatch(name, own, seed, test))
    return cls


def _dispatch(name: str, own: Callable, seed: Callable, test: FormTest) -> Callable:
    @functools.wraps(own)
    def method(self, *args: Any, **kw: Any) -> Any:
        if test(args, kw):
            return seed(self, *args, **kw)
        return own(self, *args, **kw)

    method.__signature__ = inspect.signature(seed)  # type: ignore[attr-defined]
    own_sig = inspect.signature(own)
    own_sig = own_sig.replace(parameters=list(own_sig.parameters.values())[1:])  # without self
    method.__doc__ = (
        f"{inspect.getdoc(seed)}\n\nThe engine's own form (what the drivers call): "
        f"{name}{own_sig}\n{inspect.getdoc(own) or ''}"
    )
    method.engine_method = own  # type: ignore[attr-defined]
    return method
