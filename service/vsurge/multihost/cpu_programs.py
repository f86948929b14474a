"""Multi-process groups on CPU: every program with cross-process collectives runs to its end before the
next one starts (XLA:CPU with gloo deadlocks otherwise), and every process meets the others before a
group-wide program's first run (one host may compile for minutes longer than another)."""

from __future__ import annotations

from typing import Any

_SERIALIZED = False
FIRST_RUN_BARRIER_MS = 30 * 60 * 1000  # one host may compile for many minutes longer than another


def serialize_cpu_programs() -> None:
    """XLA:CPU with gloo deadlocks when a process starts a program with cross-process collectives before
    its previous one finished (measured on jax 0.10: two back-to-back dispatches hang at random). On CPU,
    and only in a multi-process group, every program therefore runs to its end before its call returns:
    the jit fast path is turned off and each execution waits for its outputs. TPUs order their programs
    on the device and never get here."""
    global _SERIALIZED
    if _SERIALIZED:
        return
    import jax
    from jax._src import pjit
    from jax._src.interpreters import pxla

    if not hasattr(pjit, "_get_fastpath_data") or not hasattr(pxla, "ExecuteReplicated"):
        raise RuntimeError(
            f"jax {jax.__version__}: cannot serialize CPU programs for a multi-process group; "
            "run multi-process groups on TPU or with jax 0.10"
        )
    from jax._src import distributed as jax_distributed

    pjit._get_fastpath_data = lambda *a, **k: None
    run = pxla.ExecuteReplicated.__call__
    seen: dict[int, Any] = {}  # every program this process ran (kept, so their ids stay unique)
    first_runs: list[Any] = []  # the group-wide ones, in the order of their first run

    def run_to_end(self: Any, *args: Any) -> Any:
        if id(self) not in seen:
            seen[id(self)] = self
            if _spans_processes(self):
                # A program's first run follows its compile, which takes longer on one host than
                # another; gloo gives up on peers 30 s late. Every process runs the same group-wide
                # programs in the same order, so they all meet here once per program.
                first_runs.append(self)
                client = jax_distributed.global_state.client
                if client is not None:
                    client.wait_at_barrier(f"vsurge-program-{len(first_runs)}", FIRST_RUN_BARRIER_MS)
        out = run(self, *args)
        jax.block_until_ready(out)
        return out

    pxla.ExecuteReplicated.__call__ = run_to_end
    _SERIALIZED = True


def _spans_processes(execute: Any) -> bool:
    """Whether a program's inputs or outputs live on another process's devices too (a local program,
    such as a PRNG key made on one device, runs on this process alone)."""
    shardings = [
        *getattr(execute.in_handler, "in_shardings", ()),
        *getattr(execute.out_handler, "out_shardings", ()),
    ]
    return any(not getattr(s, "is_fully_addressable", True) for s in shardings)
