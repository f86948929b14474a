"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2016), pure.

Each pod owns `vnodes` points on a 64-bit ring; a key goes to the first pod clockwise from the key's own
point whose load, counting this request, stays within the bound ceil((1 + eps) * (L + 1) / n), where L is
the pods' total load and n their number. So the same key keeps going to the same pod (its KV pages are
there) until that pod holds more than its share; then the key spills to the next pod on the ring, the same
one every time, and no pod is ever above (1 + eps) times the mean. Removing a pod moves only the keys it
owned (to the next pod on the ring); adding one takes a 1/n share from the others.

A pod under the bound always exists: some pod holds at most floor(L / n) <= ceil((1 + eps)(L + 1) / n) - 1.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Collection, Iterator, Mapping, Sequence

DEFAULT_VNODES = 160


def point(data: bytes) -> int:
    """A position on the ring: the first 64 bits of blake2b."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def load_bound(total_load: int, pods: int, eps: float) -> int:
    """The most requests one of `pods` pods may hold, this one included: ceil((1 + eps) * (total + 1) / n)."""
    if pods < 1:
        raise ValueError("no pods")
    # Float error must not push a bound that is an integer in exact arithmetic up by one.
    return max(1, math.ceil((1.0 + eps) * (total_load + 1) / pods - 1e-9))


class HashRing:
    """The points of a fixed set of pods; build one per pod set (cheap: n * vnodes hashes)."""

    def __init__(self, pods: Sequence[str], vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.pods = tuple(dict.fromkeys(pods))
        ring = sorted(
            (point(f"{pod}#{i}".encode("utf-8", "surrogatepass")), pod)
            for pod in self.pods
            for i in range(vnodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [o for _, o in ring]

    def walk(self, key: bytes) -> Iterator[str]:
        """Every pod once, clockwise from the key's point."""
        if not self._points:
            return
        start = bisect.bisect_left(self._points, point(key))
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.pods):
                    return

    def owner(self, key: bytes) -> str | None:
        """The pod that owns `key` when load does not matter."""
        return next(self.walk(key), None)


def bounded_pick(
    ring: HashRing,
    key: bytes,
    loads: Mapping[str, int],
    eps: float,
    *,
    candidates: Collection[str] | None = None,
) -> str | None:
    """The first pod clockwise from `key` among `candidates` (default: every pod of the ring) whose load + 1
    is within the bound over the candidates; None when there is no candidate."""
    allowed = [p for p in ring.pods if candidates is None or p in candidates]
    if not allowed:
        return None
    bound = load_bound(sum(max(0, loads.get(p, 0)) for p in allowed), len(allowed), eps)
    allowed_set = set(allowed)
    for pod in ring.walk(key):
        if pod in allowed_set and max(0, loads.get(pod, 0)) + 1 <= bound:
            return pod
    return None  # unreachable (see the module docstring); kept for a caller's `or` fallback
