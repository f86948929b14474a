"""The transfer thread's work: prefilled packs to a decode engine's backlog, their first tokens streamed.

Every host read waits for the device work dispatched before it, and the step thread keeps a decode step (a
block of ``decode_steps`` on TPU) in flight. Reading each pack's prefill and then its first tokens one pack
at a time therefore paid two in-flight steps per pack: under a burst of prompts, time to first token grew
with the decode block's length. So the thread takes every pack that is waiting, dispatches all of their
device work (moves, first-token samplers), and only then reads the results, in order: one wait per group.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from ...engines.sampling import SampleResult
from ..queue_messages import FirstToken, Prefilled, PrefilledPack
from .slot_scheduler import DenseSlots, SlotOwner

log = logging.getLogger("vsurge.driver")

__all__ = ["transfer_group"]


@dataclasses.dataclass
class _Started:
    """A pack whose device work is dispatched and not yet read."""

    pack: PrefilledPack
    dest: DenseSlots
    prefix: Any
    picks: list[tuple[int, int]]  # (request of the pack, sample) whose first token is being sampled
    results: list[tuple[int, Any]]  # per sampler call: its picks, its device outputs


def transfer_group(driver: Any, packs: list[PrefilledPack]) -> None:
    """Move ``packs`` to decode lanes: dispatch everything, then read and hand over, oldest first."""
    started = [_start(driver, pack) for pack in packs]
    for s in started:
        if s is not None:
            _finish(driver, s)


def _start(driver: Any, pack: PrefilledPack) -> _Started | None:
    batch, prefix = pack.batch, pack.prefix
    dest = max(driver._slots, key=lambda s: len(s.free) - s.lane.backlog.qsize())
    try:
        if dest.engine is not pack.engine:
            prefix = jax.device_put(prefix, dest.engine.get_prefix_destination_sharding())
    except Exception as e:
        for req in batch:
            driver.pipeline.fail(req, f"transfer failed: {e}")
        return None
    # a structured request samples at insert, under its grammar's first mask
    picks = [
        (j, i)
        for j, req in enumerate(batch)
        if getattr(req.params, "grammar", None) is None and not req.cancelled
        for i in range(req.params.n)
    ]
    results: list[tuple[int, Any]] = []
    if picks:
        engine = dest.engine
        try:
            own = engine.entry_keys(prefix)
            keys = np.stack([own[j] if batch[j].keys is None else batch[j].keys[i] for j, i in picks])
            m = engine.max_concurrent_prefill
            for at in range(0, len(picks), m):
                part = picks[at : at + m]
                res = engine.sample_firsts(prefix, [j for j, _ in part], keys[at : at + m])
                results.append((len(part), res))
        except Exception as e:  # the insert samples them instead, and reports a failure there
            log.warning("first tokens before insert failed, sampling at insert: %s", e)
            picks, results = [], []
    return _Started(pack, dest, prefix, picks, results)


def _finish(driver: Any, s: _Started) -> None:
    p, batch = driver.pipeline, s.pack.batch
    try:
        jax.block_until_ready(s.prefix.hidden)
        p.clock.ready(s.pack.timing)
    except Exception as e:
        for req in batch:
            p.fail(req, f"transfer failed: {e}")
        return
    now = time.time()
    firsts = _stream_firsts(driver, s)
    for j, req in enumerate(batch):
        req.metadata.prefill_done_at = now
        if p.put(s.dest.lane.backlog, Prefilled(req, s.prefix, j, firsts[j])):
            p.left_pipeline(req)
        else:
            p.finish(req, "abort")


def _stream_firsts(driver: Any, s: _Started) -> list[list | None]:
    """Each sample's first token, sent to the lane's detokenizer ahead of its insert: the client sees it
    without waiting for the step in flight (or for a free slot). The insert then reuses these tokens, so the
    output is what sampling at insert gives. None for a request whose first tokens are sampled at insert (a
    structured one, or every request of the pack when sampling failed here)."""
    batch = s.pack.batch
    out: list[list | None] = [None] * len(batch)
    if not s.picks:
        return out
    try:
        rows = []
        for n, res in s.results:
            host = [np.asarray(x) for x in res]
            rows += [SampleResult(*(x[r : r + 1] for x in host)) for r in range(n)]
    except Exception as e:
        log.warning("first tokens before insert failed, sampling at insert: %s", e)
        return out
    for (j, i), first in zip(s.picks, rows, strict=True):
        out[j] = out[j] or [None] * batch[j].params.n
        out[j][i] = first
    for j, req in enumerate(batch):
        if out[j] is None:
            continue
        for i, first in enumerate(out[j]):
            # sent before the request reaches the backlog, so it precedes every step holding its tokens;
            # past the queue's bound: the bound holds back decode steps, not tokens already on the host
            s.dest.lane.detok.put_past_bound(FirstToken(SlotOwner(req, i, None), first))
    return out
