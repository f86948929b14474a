"""While a vSurge serves, its threads hand the GIL to each other every half millisecond, not every 5.

A driver's threads (prefill, transfer, generate, detokenize, the server's event loop) share one GIL, and
each device call releases it: the calling thread then waits for it until the holder releases it or the
interpreter's switch interval (5 ms by default) runs out. A prefill dispatches a chain of programs (one
per decoder layer, engines/dense/layered_prefill.py), so with the detokenize thread busy the waits added up to
tens of milliseconds of a request's first token on a TPU (the 1B shape's mixed workload on a v5e: TTFT
p50 0.17 s with one prefill program, 0.25 s with the chain). A shorter interval bounds each wait; the
price is a few more switches a second between busy threads.

Process-wide (the interval is the interpreter's), counted: the first vSurge to start sets it, the last
to stop puts the old one back.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["SERVING_SWITCH_S", "serving", "stopped"]

SERVING_SWITCH_S = 0.0005
_lock = threading.Lock()
_users = 0
_saved: float | None = None


def serving() -> None:
    """A vSurge started: shorten the switch interval (never lengthen one set shorter)."""
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, SERVING_SWITCH_S))
        _users += 1


def stopped() -> None:
    """A vSurge that called `serving` stopped: the last one restores the interval it found."""
    global _users, _saved
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0 and _saved is not None:
            sys.setswitchinterval(_saved)
            _saved = None
