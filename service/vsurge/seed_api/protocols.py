"""The seed's AbstractInferenceEngine and AbstractDriver: what an engine and a driver provide. Pure, no jax.

Both are abstract base classes a new engine or driver may subclass (the abstract members must then be
defined), and structural protocols for the ones we have: ``issubclass(vDriver, AbstractDriver)`` is true
because vDriver has every member, without inheriting from it (`__subclasshook__`), so the drivers and
engines stay free of the seed's class tree.
"""

from __future__ import annotations

import abc
from typing import Any

__all__ = ["AbstractDriver", "AbstractInferenceEngine", "provides"]


def provides(cls: type, name: str) -> bool:
    """``cls`` defines ``name`` (a method, property or class attribute) or declares it as an instance
    attribute (a class annotation) somewhere in its MRO."""
    return any(name in vars(base) or name in vars(base).get("__annotations__", {}) for base in cls.__mro__)


class _Structural(abc.ABC):  # noqa: B024 - the abstract members are its subclasses'
    """An ABC that any class providing all of ``_members`` counts as implementing."""

    _members: frozenset[str] = frozenset()

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        members = cls.__dict__.get("_members")
        if not members:
            return NotImplemented
        return True if all(provides(other, m) for m in members) else NotImplemented


class AbstractInferenceEngine(_Structural):
    """An engine: the model's limits and tokens, its decode state, and the seed's steps.

    ``prefill`` returns a prefix and the first token (ResultTokens); ``insert`` / ``bulk_insert`` place a
    prefix into decode slots; ``decode`` advances every active slot one token; ``free_resource`` releases
    a slot. vEngine and oEngine implement all of it (docs/seed.md).
    """

    _members = frozenset(
        {
            "pad_token_id",
            "eos_token_ids",
            "samples_per_slot",
            "prng_key",
            "prefill_lengths",
            "batch_size",
            "max_concurrent_decodes",
            "max_prefill_length",
            "max_length",
            "colocated_cpus",
            "get_prefix_destination_sharding",
            "init_decode_state",
            "free_resource",
            "prefill",
            "decode",
            "insert",
            "bulk_insert",
        }
    )

    @property
    @abc.abstractmethod
    def pad_token_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> list[int]: ...

    @property
    @abc.abstractmethod
    def samples_per_slot(self) -> int: ...

    @property
    @abc.abstractmethod
    def prng_key(self) -> Any: ...

    @property
    @abc.abstractmethod
    def prefill_lengths(self) -> list[int]: ...

    @property
    @abc.abstractmethod
    def batch_size(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def max_concurrent_decodes(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_prefill_length(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_length(self) -> int: ...

    @property
    @abc.abstractmethod
    def colocated_cpus(self) -> list[Any] | None: ...

    @abc.abstractmethod
    def get_prefix_destination_sharding(self) -> Any: ...

    @abc.abstractmethod
    def init_decode_state(self, *args: Any, **kwargs: Any) -> Any: ...

    @abc.abstractmethod
    def free_resource(self, slot: int) -> bool: ...

    @abc.abstractmethod
    def prefill(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]: ...

    @abc.abstractmethod
    def decode(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]: ...

    @abc.abstractmethod
    def insert(self, prefix: Any, decode_state: Any, slot: int) -> Any: ...

    @abc.abstractmethod
    def bulk_insert(self, prefix: Any, decode_state: Any, slots: list[int]) -> Any: ...


class AbstractDriver(_Structural):
    """A driver: takes ActiveRequests, runs them on its engines in background threads, streams results."""

    _members = frozenset(
        {
            "driver_name",
            "processor",
            "compile",
            "start",
            "stop",
            "submit_request",
            "place_request_on_prefill_queue",
            "get_total_concurrent_requests",
        }
    )

    @property
    @abc.abstractmethod
    def driver_name(self) -> str: ...

    @property
    @abc.abstractmethod
    def processor(self) -> Any: ...

    @abc.abstractmethod
    def compile(self) -> Any: ...

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @abc.abstractmethod
    def submit_request(self, request: Any) -> None: ...

    @abc.abstractmethod
    def place_request_on_prefill_queue(self, request: Any) -> None: ...

    @abc.abstractmethod
    def get_total_concurrent_requests(self) -> int: ...
