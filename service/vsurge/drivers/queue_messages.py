"""The messages that travel the queues between a driver's threads (typed, instead of tagged tuples).

    prefill thread --PrefilledPack--> transfer thread --Prefilled--> generate thread    (vDriver)
                                      transfer thread --FirstToken--> detokenize thread (vDriver)
    prefill thread --Arrived--> generate thread        (vDriver with mixed steps: prefilled in the steps)
    prefill thread --Prepared--> generate thread                                       (oDriver)
    generate thread --FirstToken | Step | Abort | Preempt | STOP--> detokenize thread

Each class says what one hand-off carries; a consumer dispatches on the type. `owner` / `owners` are the
driver's own unit of work, an *owner* with ``req`` and ``index``: a `SlotOwner` in vDriver, a paged `Seq` in
oDriver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .active_request import ActiveRequest


@dataclass(frozen=True, slots=True)
class PrefilledPack:
    """Prompts prefilled in one call (vDriver's prefill -> transfer queue)."""

    batch: list[ActiveRequest]
    engine: Any  # the engine that prefilled them (its devices hold `prefix`)
    prefix: Any  # the engine's Prefix; entry j belongs to batch[j]
    timing: Any = None  # step_timing.Dispatched of the prefill call


@dataclass(frozen=True, slots=True)
class Prefilled:
    """One prefilled request waiting for free slots (a decode lane's backlog)."""

    req: ActiveRequest
    prefix: Any
    index: int  # its entry in `prefix`
    firsts: list[Any] | None = None  # each sample's first token, already streamed (None: sampled at insert)


@dataclass(frozen=True, slots=True)
class Arrived:
    """A request whose prompt the decode steps prefill in place, chunk by chunk (vDriver's mixed steps)."""

    req: ActiveRequest


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request whose sequences are ready for the paged scheduler (oDriver's backlog)."""

    req: ActiveRequest
    seqs: list[Any]


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The token sampled right after a prompt's prefill, for one sample."""

    owner: Any
    result: Any  # SampleResult with one row
    timing: Any = None  # step_timing.Dispatched of the prefill step that sampled it (oDriver), else None


@dataclass(frozen=True, slots=True)
class Step:
    """One decode step's results; row r belongs to owners[r] (None: an idle row)."""

    result: Any  # SampleResult, still being copied to the host when sent
    owners: list[Any]
    timing: Any = None  # step_timing.Dispatched: the step's kind and dispatch time


@dataclass(frozen=True, slots=True)
class Abort:
    """The request ended without finishing (cancelled, or the driver stopping)."""

    req: ActiveRequest


@dataclass(frozen=True, slots=True)
class Preempt:
    """A decoding sequence lost its pages (oDriver): recompute it once its tokens so far are accounted."""

    seq: Any


def requests_of(item: Any) -> list[ActiveRequest]:
    """The requests a queued message holds (to abort them when a driver stops with it still queued)."""
    if isinstance(item, ActiveRequest):
        return [item]
    if isinstance(item, PrefilledPack):
        return list(item.batch)
    if isinstance(item, Arrived | Prefilled | Prepared | Abort):
        return [item.req]
    if isinstance(item, FirstToken | Preempt):
        owner = item.owner if isinstance(item, FirstToken) else item.seq
        return [owner.req]
    if isinstance(item, Step):
        return list({id(o.req): o.req for o in item.owners if o is not None}.values())
    return []


class _Stop:
    def __repr__(self) -> str:
        return "STOP"


STOP = _Stop()  # the generate thread's last message to its detokenizer
