"""The leader's engine as its driver sees it, and what a worker may be asked to run.

Every engine method that runs device programs or changes the engine's state is a *lane method*: the
``LeaderEngine`` sends it to every worker, then runs it (``LeaderLane.call``). Sub-objects of the engine
with programs of their own (``engine.mixed``, vDriver's in-place prefill steps) are proxied the same way,
by path (``"mixed.step"``). Host-only helpers and plain settings read the leader's engine alone. Anything
else is refused with an AttributeError naming it, so no access that reaches device state can bypass the
lane unnoticed; a worker runs only paths in ``LANE_METHODS``.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from . import wire

# Engine calls that run programs or change engine state: sent to every worker, then run on the leader.
LANE_METHODS = frozenset(
    {
        # vEngine
        "init_decode_state",
        "prefill",
        "prefill_many",
        "prefill_chunked",
        "insert",
        "bulk_insert",
        "sample_first",
        "sample_firsts",
        "decode",
        "decode_block",
        "verify",
        "decode_logits",
        "decode_sample",
        "move_slots",
        "free_resource",
        "compile",
        "warm_structured",
        "warm_chunked",
        "score_prompt",
        # oEngine
        "seq_inputs",
        "prefill_chunk",
        "step",
        "step_logits",  # structured output: the forward, then the samplers under the token masks
        "step_sample",
        # vEngine.mixed (max_num_batched_tokens on vdriver: prompts prefilled inside the decode steps)
        "mixed.step",
        "mixed.seat",
        # the LoRA bank (engines/lora_bank.py): an adapter's host weights cross once, when it is added
        # (stage); a slot is then written from each process's copy (load), every shard where it lives
        "lora_bank.stage",
        "lora_bank.unstage",
        "lora_bank.load",
        "lora_bank.warm",
    }
)
# Calls that may run for minutes (compiling): bounded by the start timeout, not the step bound.
LONG_METHODS = frozenset({"compile", "warm_structured", "warm_chunked", "lora_bank.warm"})
# Host-only computations from the engine's settings and host mirrors: the leader's engine answers alone.
LOCAL_METHODS = frozenset(
    {
        "check_prompt",
        "needs_chunks",
        "bucket_for",
        "pack_rows_for",
        "decode_bucket",
        "rows_for",
        "read_lengths",
        "entry_keys",
        "pages_bucket",
        "prefill_shapes",
        "step_shape",
        "get_state_shardings",
        "get_prefix_destination_sharding",
        "make_sampling_row",  # host arrays only (the seat call takes the request's key explicitly)
        "_replicated",  # a sharding, to place oDriver's page table
        "mixed.step_plan",
    }
)
# Attributes the drivers read that are not plain values: settings objects and host-side bookkeeping.
LOCAL_ATTRIBUTES = frozenset(
    {
        "model_config",
        "engine_config",
        "processor",
        "mesh",
        "structured_ready",  # a threading.Event the leader's warm_structured sets
        "manager",  # oEngine's host page manager: only the leader's scheduler allocates pages
        "logits_sharding",
        "speculator.k",
        "speculator.cost_ratio",  # measured per process at compile; only the leader's driver decides
        "mixed.budget",
        "mixed.shapes",
    }
)
SUB_OBJECTS = frozenset({"mixed", "speculator", "lora_bank"})
# Attributes a driver sets on its engine (oDriver drops compile()'s spare state once it runs).
SETTABLE = frozenset({"_spare"})


def _plain(value: Any, depth: int = 0) -> bool:
    """Host data that holds no device array: numbers, strings, numpy values, containers of those."""
    if value is None or isinstance(value, bool | int | float | str | bytes | np.ndarray | np.generic):
        return True
    if depth < 3 and isinstance(value, list | tuple | frozenset | set):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


class LaneRefused(AttributeError):
    """An engine attribute the lane does not carry: reading it on the leader alone would diverge."""


class LeaderEngine:
    """The engine (or one of its sub-objects, ``prefix`` "mixed.") behind the step lane."""

    def __init__(self, engine: Any, lane: Any, prefix: str = ""):
        object.__setattr__(self, "_target", engine)
        object.__setattr__(self, "_lane", lane)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str) -> Any:
        path = self._prefix + name
        value = getattr(self._target, name)
        if path in LANE_METHODS:
            return _LaneMethod(self._lane, self._target, path, name)
        if path in LOCAL_METHODS or path in LOCAL_ATTRIBUTES:
            return value
        if path in SUB_OBJECTS:
            return None if value is None else LeaderEngine(value, self._lane, path + ".")
        if isinstance(value, types.MethodType | types.BuiltinMethodType):
            raise LaneRefused(
                f"engine method {path!r} is neither sent down the step lane nor known to be host-only: "
                "add it to LANE_METHODS or LOCAL_METHODS (vsurge/multihost/engine_proxy.py)"
            )
        if _plain(value):
            return value
        raise LaneRefused(
            f"engine attribute {path!r} ({type(value).__name__}) may hold device state the workers "
            "would not see: reach it through a lane method (vsurge/multihost/engine_proxy.py)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if self._prefix or name not in SETTABLE:
            raise LaneRefused(f"setting engine attribute {self._prefix + name!r} is not carried by the lane")
        self._lane.set_attribute(self._target, name, value)

    @property
    def engine(self) -> Any:
        """The leader's real engine (for host-only inspection)."""
        return self._target


class _LaneMethod:
    """A bound lane method: ``proxy.decode(state)`` sends ("decode", args) and runs it here."""

    __slots__ = ("lane", "target", "path", "name")

    def __init__(self, lane: Any, target: Any, path: str, name: str):
        self.lane, self.target, self.path, self.name = lane, target, path, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.lane.call(self.path, getattr(self.target, self.name), args, kwargs)


def worker_method(engine: Any, path: str) -> Any:
    """The bound method a worker runs for ``path``; LookupError for anything outside LANE_METHODS."""
    if path not in LANE_METHODS:
        raise LookupError(f"the leader asked for {path!r}, which is not a lane method")
    target = engine
    *parents, name = path.split(".")
    for part in parents:
        target = getattr(target, part)
        if target is None:
            raise LookupError(f"the leader asked for {path!r}, which this engine does not have")
    return getattr(target, name)


def worker_setattr(engine: Any, name: str, value: Any) -> None:
    if name not in SETTABLE:
        raise LookupError(f"the leader set engine attribute {name!r}, which the lane does not carry")
    setattr(engine, name, value)


def build_engine(model: Any, processor: Any, config: Any) -> Any:
    """The engine config.driver names, as Surge.from_config builds it."""
    if config.driver == "odriver":
        from ..engines.paged.oengine import PagedEngine

        return PagedEngine(model, processor, config)
    from ..engines.dense.vengine import DenseEngine

    return DenseEngine(model, processor, config)


def engine_setup(engine: Any, config: Any) -> dict[str, Any]:
    """What a worker needs to build the same engine: the config (the mesh as its spec string), with the
    KV cache's size fixed to the leader's page count (free memory differs a little from host to host)."""
    setup: dict[str, Any] = {
        "config": config,
        "mesh": dict(engine.mesh.shape) if engine.mesh is not None else None,
    }
    storage = getattr(engine, "storage", None)
    if storage is not None:
        setup["config"] = config.replace(kv_cache_bytes=int(storage.nbytes))
        setup["num_pages"] = int(storage.num_pages)
    return setup


def register_records() -> None:
    """The engine's records that cross the lane (wire.RECORDS), by name."""
    from ..contracts.engine_config import EngineConfig
    from ..contracts.sampling_params import SamplingParams
    from ..engines.dense.mixed_step import Chunk
    from ..engines.dense.spec_verify import VerifyStep
    from ..engines.dense.vengine import GenerationState, Prefix
    from ..engines.paged.mixed_step import ChunkWork
    from ..engines.paged.oengine import PagedState, SeqInputs
    from ..engines.sampling import SampleResult, SlotSampling

    for cls in (GenerationState, Prefix, PagedState, SeqInputs, SampleResult, SlotSampling, VerifyStep):
        wire.register(cls)
    wire.register(Chunk, "DenseChunk")
    wire.register(ChunkWork)
    wire.register(SamplingParams)
    wire.register(EngineConfig)
