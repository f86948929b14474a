"""`vsurge serve`'s default slots and context, sized from the device's memory (as vLLM sizes its KV cache).

With neither ``--max-concurrent-decodes`` nor ``--max-length`` set, a server takes the memory left after
its weights, keeps ``hbm_utilization`` of it for the KV cache (the knob odriver sizes its pages with; the
rest holds prefill's activations, the sampler's buffers and the programs), and splits that between slots
and context:

1. context: the model's ``max_position_embeddings``, at most ``MAX_LENGTH_CAP`` (2048);
2. slots: as many rows of that context as the budget holds, in multiples of 8 (TPU sublanes; XLA:CPU
   does not care), at most the backend's cap;
3. when that leaves fewer than a quarter of the cap, the context is halved (down to 512) to buy slots:
   arriving traffic needs slots more than it needs 2048-token rows.

Why the caps (``slot_cap``). TPU 128: a decode step reads every weight once whatever the rows, so rows
are nearly free until the KV a step reads rivals the weights; on one v5e with Llama-3.2-1B (2026-12-07,
issue 52) 128 slots ran the fixed batch at 17,250 tok/s against 11,727 at 64, and arriving traffic at
5,842 against 4,877, while serve's old 16 slots gave 3,035. 256 was not measured: the cap stays where a
measurement says more still pays. GPU 256: vLLM's own ``max_num_seqs``. CPU 8 per core (16 on the
2-core CI machine, the old default): XLA:CPU's step time grows with the rows (the decode row buckets are
powers of two for that reason), so past a few rows per core more slots only stretch every stream's TPOT.

Pure: memory, weights and shapes are arguments (``size``); `measure` reads them from a loaded model and
the devices, `estimate` from a config.json alone (``--print-config``, no weights loaded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..contracts.engine_config import MAX_LENGTH_CAP

__all__ = ["Sizing", "size", "slot_cap", "measure", "estimate", "cpu_count", "host_memory_bytes"]

MIN_CONTEXT = 512  # the context is not halved below this to buy slots
SLOT_ALIGN = 8


_CAP_WHY = {
    "tpu": "past 128 not measured to pay",
    "gpu": "vLLM's max_num_seqs",
    "cpu": "8 per core: XLA:CPU's step time follows the rows",
}


def cpu_count() -> int:
    """Cores this process may run on (a container's CPU set, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def slot_cap(backend: str, cores: int) -> int:
    """The most slots worth having on ``backend`` (the module's docstring says why each)."""
    if backend == "tpu":
        return 128
    if backend == "gpu":
        return 256
    return max(SLOT_ALIGN, SLOT_ALIGN * cores)


@dataclass(frozen=True)
class Sizing:
    """The sizing's answer and the numbers it came from (``--print-config`` and the start log show them)."""

    slots: int
    context: int
    backend: str
    memory_bytes: int  # the devices' memory (a TPU's HBM, the host's RAM on CPU)
    weights_bytes: int
    kv_bytes_per_token: int  # per slot and context position, every layer's K and V
    fraction: float
    cap: int
    max_position: int
    why: str

    @property
    def budget_bytes(self) -> int:
        return int(self.fraction * max(0, self.memory_bytes - self.weights_bytes))

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"{self.backend} memory {self.memory_bytes / gib:.1f} GiB - weights {self.weights_bytes / gib:.2f} GiB, "
            f"x {self.fraction:g} = KV budget {self.budget_bytes / gib:.2f} GiB at "
            f"{self.kv_bytes_per_token / 1024:.1f} KiB per slot-token; cap {self.cap} slots "
            f"({_CAP_WHY.get(self.backend, _CAP_WHY['cpu'])}); {self.why}"
        )


def _round_context(n: int) -> int:
    # tidy shapes: prefill buckets and decode read chunks divide a multiple of 128
    return n - n % 128 if n >= 128 else n


def _fit(budget: int, per_token: int, context: int, cap: int) -> int:
    rows = budget // max(1, per_token * context)
    if rows >= SLOT_ALIGN:
        rows -= rows % SLOT_ALIGN
    return int(max(1, min(cap, rows)))


def size(
    *,
    backend: str,
    memory_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token: int,
    max_position: int,
    fraction: float,
    cores: int = 1,
    slots: int | None = None,
    context: int | None = None,
) -> Sizing:
    """Slots and context for these numbers; ``slots`` / ``context`` given (a flag or variable) are kept,
    and only the other one is sized around them."""
    cap = slot_cap(backend, cores)
    budget = int(fraction * max(0, memory_bytes - weights_bytes))
    model_context = max(1, min(max_position, MAX_LENGTH_CAP))
    common = dict(
        backend=backend, memory_bytes=memory_bytes, weights_bytes=weights_bytes,
        kv_bytes_per_token=kv_bytes_per_token, fraction=fraction, cap=cap, max_position=max_position,
    )  # fmt: skip
    if slots is not None and context is not None:
        return Sizing(slots, context, why="both set", **common)  # type: ignore[arg-type]
    if slots is not None:  # context from what the set slots leave, at most the model's
        fits = budget // max(1, kv_bytes_per_token * slots)
        ctx = _round_context(int(max(min(model_context, 16), min(model_context, fits))))
        return Sizing(slots, ctx, why="slots set: the context they leave room for", **common)  # type: ignore[arg-type]
    ctx = context if context is not None else model_context
    n = _fit(budget, kv_bytes_per_token, ctx, cap)
    first = f"{budget // max(1, kv_bytes_per_token * ctx)} rows of {ctx} fit"
    if context is None:
        why = f"context: the model's {max_position}, at most {MAX_LENGTH_CAP}"
        while n < cap // 4 and ctx // 2 >= MIN_CONTEXT:
            ctx //= 2
            n = _fit(budget, kv_bytes_per_token, ctx, cap)
            why = f"context halved to {ctx} for at least {cap // 4} slots ({first})"
    else:
        why = "context set"
    fits = budget // max(1, kv_bytes_per_token * ctx)
    why += f"; slots: {'the cap' if n == cap else 'what fits'} ({fits} rows of {ctx} fit the budget)"
    return Sizing(n, ctx, why=why, **common)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ reading the numbers


def host_memory_bytes() -> int:
    """The machine's physical memory: a CPU server's "device"."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory_bytes(devices: list[Any]) -> tuple[str, int]:
    """(backend, bytes) of ``devices`` together: each accelerator's memory limit, or the host's RAM."""
    backend = devices[0].platform
    if backend == "cpu":
        return backend, host_memory_bytes()
    total = 0
    for d in devices:
        stats = d.memory_stats() or {}
        total += int(stats.get("bytes_limit", 0))
    return backend, total or host_memory_bytes()


def kv_itemsize(engine: Any, dtype: str | None, backend: str) -> int:
    """Bytes of one KV element: vdriver's bfloat16 cache, else the activations' dtype (int8 weights keep
    bf16 activations)."""
    if getattr(engine, "kv_cache_dtype", "auto") == "bfloat16":
        return 2
    name = dtype or ("float32" if backend == "cpu" else "bfloat16")
    return 4 if name == "float32" else 2


def kv_bytes_per_token(model_config: Any, itemsize: int) -> int:
    return int(model_config.num_layers * 2 * model_config.num_kv_heads * model_config.head_dim * itemsize)


def _given(engine: Any, explicit: frozenset[str] | set[str]) -> tuple[int | None, int | None]:
    slots = engine.max_concurrent_decodes if "max_concurrent_decodes" in explicit else None
    context = engine.max_length if "max_length" in explicit else None
    return slots, context


def measure(
    engine: Any, explicit: frozenset[str] | set[str], model: Any, dtype: str | None, devices: list[Any]
) -> Sizing:
    """Sizing for a loaded model on ``devices`` (its mesh's; ``vsurge serve``'s start)."""
    import jax
    from flax import nnx

    backend, memory = device_memory_bytes(devices)
    weights = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, "nbytes"))
    slots, context = _given(engine, explicit)
    return size(
        backend=backend, memory_bytes=memory, weights_bytes=weights,
        kv_bytes_per_token=kv_bytes_per_token(model.config, kv_itemsize(engine, dtype, backend)),
        max_position=model.config.max_position_embeddings, fraction=engine.hbm_utilization,
        cores=cpu_count(), slots=slots, context=context,
    )  # fmt: skip


def estimate_weights_bytes(cfg: Any, itemsize: int, int8: bool = False) -> int:
    """A Llama-family checkpoint's weight bytes from its config alone (int8: the matmuls at 1 byte, the
    embedding table, norms and scales left at ``itemsize``)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    head = 0 if cfg.tie_word_embeddings else v * h
    matmul = cfg.num_layers * per_layer + head
    return matmul * (1 if int8 else itemsize) + v * h * itemsize + (2 * cfg.num_layers + 1) * h * itemsize


def estimate(
    engine: Any, explicit: frozenset[str] | set[str], model_config: Any, dtype: str | None, devices: list[Any]
) -> Sizing:
    """Sizing from a config.json's shapes (no weights loaded): what `measure` will find at start."""
    backend, memory = device_memory_bytes(devices)
    itemsize = 4 if (dtype or ("float32" if backend == "cpu" else "bfloat16")) == "float32" else 2
    weights = estimate_weights_bytes(model_config, itemsize, engine.quantization == "int8")
    slots, context = _given(engine, explicit)
    return size(
        backend=backend, memory_bytes=memory, weights_bytes=weights,
        kv_bytes_per_token=kv_bytes_per_token(model_config, kv_itemsize(engine, dtype, backend)),
        max_position=model_config.max_position_embeddings, fraction=engine.hbm_utilization,
        cores=cpu_count(), slots=slots, context=context,
    )  # fmt: skip


def apply(engine: Any, sizing: Sizing) -> Any:
    """``engine`` (an EngineConfig) with the sized slots and context."""
    return engine.replace(max_concurrent_decodes=sizing.slots, max_length=sizing.context)
