"""The routing policies over one model's pods: `least-load`, `prefix` and `round-robin`.

- `least-load`: the pod with the most headroom (load_picking.pick_least_load).
- `prefix`: requests that share a prompt prefix go to a pod that holds its KV pages. The prompt's chained
  block hashes (prefix.py) are looked up in a per-model index of the pods recent requests went to: the
  deepest block seen, if it is at least as deep as the ring key, on a pod under the load bound, wins (a
  multi-turn chat follows its own history; a system prompt that spilled to a second pod is found on
  either). Otherwise the key is the hash of the first `key_blocks` blocks (or of every full block of a
  shorter prompt) and the pod is found by consistent hashing with bounded load (hashring.py): the same
  system prompt, few-shot block or conversation start goes to the same pod until that pod is above
  (1 + eps) times the mean load, then to the next pod on the ring. A prompt shorter than one block has
  nothing to share and goes by least-load.
- `round-robin`: each pod in turn (the baseline the benchmarks compare against).

`routing=None` ("auto") picks per model: `prefix` when its pods report the paged driver (odriver, the
one with a prefix cache), else `least-load`. A retry excludes the pods already tried and picks again by
the same policy. Loads are `load_picking.estimated_load`: the router's own in-flight requests plus what `/load`
reports.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from .hashring import DEFAULT_VNODES, HashRing, bounded_pick, load_bound
from .load_picking import LoadReport, LoadTracker, estimated_load, pick_least_load, pick_round_robin, usable
from .loadpoll import LoadBook
from .lora import AdapterBook, adapter_candidates

POLICIES = ("least-load", "prefix", "round-robin")


@dataclass(frozen=True)
class Decision:
    upstream: str
    policy: str
    how: str  # prefix_match, prefix_hash, least_load, round_robin
    adapter: str | None = None  # a LoRA adapter's request: in_use, listed or any (lora.adapter_candidates)


class PrefixIndex:
    """Block hash -> the pods recent requests holding that block went to (the last `per_block`, most recent
    last): the pods likely to still hold its KV pages. Least recently used blocks are evicted."""

    def __init__(self, capacity: int = 65536, per_block: int = 4) -> None:
        self.capacity = max(1, capacity)
        self.per_block = max(1, per_block)
        self._pods: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pods)

    def get(self, key: bytes) -> tuple[str, ...]:
        return self._pods.get(key, ())

    def record(self, hashes: Sequence[bytes], pod: str) -> None:
        for h in hashes:
            pods = tuple(p for p in self._pods.get(h, ()) if p != pod) + (pod,)
            self._pods[h] = pods[-self.per_block :]
            self._pods.move_to_end(h)
        while len(self._pods) > self.capacity:
            self._pods.popitem(last=False)

    def forget(self, pods: Collection[str]) -> None:
        """Drop pods that are gone (their cache went with them)."""
        for key in list(self._pods):
            kept = tuple(p for p in self._pods[key] if p not in pods)
            if kept:
                self._pods[key] = kept
            else:
                del self._pods[key]


def prefix_decision(
    hashes: Sequence[bytes],
    candidates: Sequence[str],
    loads: dict[str, int],
    *,
    eps: float,
    key_blocks: int,
    index: PrefixIndex | None,
    ring: HashRing,
) -> tuple[str, str] | None:
    """The pod for a prompt with these block hashes, and how it was found (pure but for the index read).

    The deepest block (at least `key_blocks` deep) that a candidate under the load bound was sent: of
    those pods, the least loaded (the most recent on a tie). Else the key block's place on the ring.
    None when the prompt has no full block (the caller falls back to least-load).
    """
    if not hashes or not candidates:
        return None
    allowed = set(candidates)
    bound = load_bound(sum(loads.get(c, 0) for c in candidates), len(candidates), eps)
    depth = min(len(hashes), key_blocks)
    if index is not None:
        for i in range(len(hashes) - 1, depth - 2, -1):
            holders = [
                p for p in reversed(index.get(hashes[i])) if p in allowed and loads.get(p, 0) + 1 <= bound
            ]
            if holders:
                return min(holders, key=lambda p: loads.get(p, 0)), "prefix_match"
    pod = bounded_pick(ring, hashes[depth - 1], loads, eps, candidates=allowed)
    return (pod, "prefix_hash") if pod is not None else None


class Picker:
    """Chooses the pod for each attempt; holds the tracker, the load reports and the prefix indexes."""

    def __init__(
        self,
        tracker: LoadTracker,
        book: LoadBook | None = None,
        *,
        routing: str | None = None,
        eps: float = 0.25,
        key_blocks: int = 4,
        index_capacity: int = 65536,
        vnodes: int = DEFAULT_VNODES,
        adapters: AdapterBook | None = None,
    ) -> None:
        if routing is not None and routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {routing!r}")
        self.tracker = tracker
        self.book = book
        self.routing = routing
        self.eps = eps
        self.key_blocks = max(1, key_blocks)
        self.index_capacity = index_capacity
        self.vnodes = vnodes
        self.adapters = adapters
        self._indexes: dict[str, PrefixIndex] = {}
        self._rings: OrderedDict[tuple[str, ...], HashRing] = OrderedDict()

    def policy_for(self, model: str, upstreams: Sequence[str]) -> str:
        if self.routing is not None:
            return self.routing
        driver = self.book.driver(model, upstreams) if self.book is not None else None
        return "prefix" if driver == "odriver" else "least-load"

    def ring(self, pods: Sequence[str]) -> HashRing:
        key = tuple(sorted(pods))
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = HashRing(key, self.vnodes)
            while len(self._rings) > 64:  # pod sets change rarely; a few recent ones suffice
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        return ring

    def index(self, model: str) -> PrefixIndex:
        idx = self._indexes.get(model)
        if idx is None:
            idx = self._indexes[model] = PrefixIndex(self.index_capacity)
        return idx

    def pick(
        self,
        model: str,
        upstreams: Sequence[str],
        hashes: Sequence[bytes] = (),
        exclude: Collection[str] = (),
        base: str | None = None,
    ) -> Decision | None:
        """The pod for the next attempt of a request for `model`, or None when every pod was tried.

        `base`: `model` is an alias (a LoRA adapter) served by `base`'s pods; the policy is the base's, and
        the pods that have the adapter are preferred within the load bound (lora.adapter_candidates)."""
        reports = self.book.fresh(upstreams) if self.book is not None else {}
        avoid = self.tracker.ejected() | {u for u, r in reports.items() if not r.ready}
        candidates = usable(upstreams, exclude=exclude, avoid=avoid)
        if not candidates:
            return None
        policy = self.policy_for(base or model, upstreams)
        turn = self.tracker.next_turn()
        in_flight = self.tracker.in_flight
        affinity = None
        if base is not None and self.adapters is not None:
            pods = self.adapters.fresh(candidates)
            if pods:
                loads = {c: estimated_load(in_flight.get(c, 0), reports.get(c)) for c in candidates}
                candidates, affinity = adapter_candidates(model, candidates, pods, loads, self.eps)
        decision = self._pick(model, policy, candidates, reports, hashes, turn)
        if decision is None or affinity is None:
            return decision
        return Decision(decision.upstream, decision.policy, decision.how, affinity)

    def _pick(
        self,
        model: str,
        policy: str,
        candidates: list[str],
        reports: dict[str, LoadReport],
        hashes: Sequence[bytes],
        turn: int,
    ) -> Decision | None:
        in_flight = self.tracker.in_flight
        if policy == "round-robin":
            chosen = pick_round_robin(candidates, turn=turn)
            return Decision(chosen, policy, "round_robin") if chosen else None
        if policy == "prefix" and hashes:
            loads = {c: estimated_load(in_flight.get(c, 0), reports.get(c)) for c in candidates}
            found = prefix_decision(
                hashes,
                candidates,
                loads,
                eps=self.eps,
                key_blocks=self.key_blocks,
                index=self.index(model),
                ring=self.ring(candidates),
            )
            if found is not None:
                self.index(model).record(hashes, found[0])
                return Decision(found[0], policy, found[1])
        chosen = pick_least_load(candidates, in_flight, reports, turn=turn)
        return Decision(chosen, policy, "least_load") if chosen else None

    def forget(self, gone: Collection[str]) -> None:
        """Pods that left: their cached prefixes are gone with them."""
        for idx in self._indexes.values():
            idx.forget(gone)


class ForgetGonePods:
    """Follows the endpoint table like a discovery source: a pod that leaves every model's endpoints (its
    EndpointSlice entry went: deleted, or unready) leaves the prefix indexes too, instead of aging out."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self._task: asyncio.Task[None] | None = None

    async def start(self, table: Any) -> None:
        self._task = asyncio.create_task(self._follow(table), name="vsurge-router-forget-gone")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self, table: Any) -> None:
        known: set[str] = set()
        while True:
            changed = table.changed_event()
            now = {u for view in table.models() for u in view.upstreams}
            gone = known - now
            if gone:
                self.picker.forget(gone)
            known = now
            await changed.wait()
