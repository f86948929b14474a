"""A jitted program that runs executables handed to it: compiled at start-up, or read back whole from disk.

`program(fun, **jit_kwargs)` is `jax.jit(fun, **jit_kwargs)` (its `lower`, `eval_shape`, ... are the jit's)
that can also hold ready executables (`use`). A call whose arguments have the shapes of one of them runs
it directly; any other call (tracers, keywords, a signature nothing compiled) goes to the jit.

Why: a start compiles every program from example arguments (`engine_base.compile_jobs`); the jit's own
cache only learns those signatures once a real call traces and lowers the program again, which at a warm
start is most of its time (a v5e, the 1B shape: 69 programs, ~6 s of tracing and ~6 s of lowering under
one GIL, for executables JAX's cache already held). An executable read from disk
(vsurge/models/compiled/executable_store.py) has no jit behind it at all: this is how calls reach it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["AotProgram", "program", "shapes_of", "missed", "missed_since"]

log = logging.getLogger(__name__)
_missed: Counter[str] = Counter()  # program name -> calls that fell through to its jit (bounded by names)
_missed_lock = threading.Lock()


def missed() -> dict[str, int]:
    """Per program name, the calls that fell through to its jit so far in this process (a copy)."""
    with _missed_lock:
        return dict(_missed)


def missed_since(before: dict[str, int]) -> dict[str, int]:
    """The calls that fell through since ``before`` (an earlier `missed()`), per program name."""
    now = missed()
    return {k: v - before.get(k, 0) for k, v in now.items() if v > before.get(k, 0)}


def shapes_of(tree: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``tree``'s leaves: how a call finds its executable (an ArgInfo, an array, a numpy
    or Python scalar alike)."""
    return tuple(
        tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape) for x in jax.tree.leaves(tree)
    )


class AotProgram:
    """``jax.jit(fun, **jit_kwargs)`` plus the executables `use` hands it, by the shapes of their arguments."""

    def __init__(self, fun: Callable[..., Any], **jit_kwargs: Any):
        self.fun = fun
        self.jit = jax.jit(fun, **jit_kwargs)
        self._ready: dict[tuple, list[Any]] = {}
        self._only: Any = None  # the one executable, when there is one: a call skips the lookup
        self._missed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jit, name)  # lower, eval_shape, trace, _cache_size

    @property
    def executables(self) -> int:
        return sum(len(v) for v in self._ready.values())

    def use(self, compiled: Any) -> None:
        """Calls with ``compiled``'s argument shapes run it (a `jax.stages.Compiled` of this program)."""
        found = self._ready.setdefault(shapes_of(compiled.args_info), [])
        found.insert(0, compiled)
        self._only = compiled if self.executables == 1 else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or not self._ready:
            return self.jit(*args, **kwargs)
        only = self._only
        if only is not None:
            try:
                return only(*args)
            except (TypeError, ValueError) as e:  # another signature (or a tracer): the jit's
                return self._fallback(e, args)
        for compiled in self._ready.get(shapes_of(args), ()):
            try:
                return compiled(*args)
            except (TypeError, ValueError):
                continue
        return self._fallback(None, args)

    def _fallback(self, error: Exception | None, args: tuple) -> Any:
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            with _missed_lock:
                _missed[self.name] += 1
            if not self._missed:  # said once: a signature the start did not compile
                self._missed = True
                log.info("%s: a call no compiled executable takes, run by jit (%s)", self.name, error)
        return self.jit(*args)

    @property
    def name(self) -> str:
        fun = self.fun
        while hasattr(fun, "func"):
            fun = fun.func
        return getattr(fun, "__qualname__", repr(fun))


def program(fun: Callable[..., Any], **jit_kwargs: Any) -> AotProgram:
    """``jax.jit(fun, **jit_kwargs)`` whose calls can run ready executables (see the module docstring)."""
    return AotProgram(fun, **jit_kwargs)
