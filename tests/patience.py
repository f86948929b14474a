"""How long the suite waits for what it expects to happen.

A wait names the seconds an idle machine needs; it returns as soon as its condition holds, and gives up only
at ``ceiling(seconds)``: several times that, and at least a minute. The suite runs on two shared cores beside
its own xdist workers and whatever else the machine does: there a 20 s wait for a router to list a model took
29 s, and failed a run that was right. So a loaded machine slows a run, never fails it, and a fast one is not
slowed (every wait polls). ``VSURGE_TEST_PATIENCE=1`` waits exactly the named seconds (to find tight waits on
an idle machine); a wait that outlasts its named seconds says so on stderr (shown with a failure, or -s).
"""

from __future__ import annotations

import os
import sys

FACTOR = float(os.environ.get("VSURGE_TEST_PATIENCE", "6"))
FLOOR_S = 60.0


def ceiling(seconds: float) -> float:
    """When a wait named ``seconds`` gives up."""
    if FACTOR <= 1:
        return seconds
    return max(seconds * FACTOR, FLOOR_S, seconds)


def note_slow(took: float, seconds: float, what: str) -> None:
    """Say that a wait outlasted the seconds it named (the machine was slow, or the wait is tight)."""
    if took > seconds:
        print(
            f"[patience] waited {took:.1f}s for {what or 'a condition'} (named {seconds:g}s)", file=sys.stderr
        )
