"""Which operator replica is active: kopf peering with priorities by seniority.

kopf pauses every replica that sees a live peer of higher priority, and *all* replicas when two share the
highest one, so the replicas of one Deployment need distinct priorities. Seniority gives them: the
replica that started first ranks highest and stays active; a replacement pod (started later) waits as a
standby instead of taking over again, so one failure means one hand-over. A killed leader is taken over
when its peering entry expires (``peering_lifetime_seconds``); one stopped with SIGTERM leaves at once.
"""

from __future__ import annotations

import os
import socket
import time
import zlib

# Milliseconds before this epoch rank higher: later starts get lower priorities (2**41 ms is year 2039).
_EPOCH_MS = 2**41
_TIE_BITS = 10


def seniority_priority(started_at: float | None = None, identity: str | None = None) -> int:
    """A priority that falls with the start time (ms); ties in the same millisecond are broken by a
    hash of the pod name and pid, so two replicas practically never share one."""
    started_ms = int((time.time() if started_at is None else started_at) * 1000)
    who = identity if identity is not None else f"{socket.gethostname()}/{os.getpid()}"
    tie = zlib.crc32(who.encode()) % (1 << _TIE_BITS)
    return ((_EPOCH_MS - started_ms) << _TIE_BITS) + tie
