"""How `make test` spreads the suite over pytest-xdist workers: whole test files per worker, all of
tests/cluster on one, and a crashed worker's remaining tests handed on instead of a hang.

A file's module fixtures (a compiled engine, a started server) are built once when the whole file runs on
one worker; tests/cluster shares one booted cluster. xdist's file scheduler (3.8) puts a crashed worker's
whole workload back on the queue, finished files and the test that crashed included: a finished file is
sent to the replacement worker as an empty batch, which it waits on forever, and the crashing test runs
again; and the replacement is handed one file, which it does not start while it may yet get more. The run
then hangs until CI's own limit instead of reporting the one failed test. Here only the tests not yet run
go back, the crashed one (already reported failed by xdist) excepted, and a worker is always topped up.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling


def scope_of(nodeid: str) -> str:
    """The unit one worker runs whole: the test file, or all of tests/cluster."""
    path = nodeid.split("::", 1)[0]
    return "tests/cluster" if path.startswith("tests/cluster/") else path


def left_after_crash(workload: dict[str, dict[str, bool]]) -> tuple[str | None, dict[str, dict[str, bool]]]:
    """The test a crashed worker was running (its first unfinished one, as xdist runs a batch in order) and
    the work still to do, by scope, without that test, finished tests or emptied scopes."""
    crashed = next((nid for unit in workload.values() for nid, done in unit.items() if not done), None)
    left: dict[str, dict[str, bool]] = {}
    for scope, unit in workload.items():
        todo = {nid: False for nid, done in unit.items() if not done and nid != crashed}
        if todo:
            left[scope] = todo
    return crashed, left


class FileScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _reschedule(self, node: Any) -> None:
        # xdist tops a worker up by one file per finished test, but a worker runs a test only once it knows
        # the next one (or is told there are none): a replacement handed a one-test file waits forever.
        # Top up to more than two pending tests at once, and say "no more" as soon as the queue is empty.
        if node.shutting_down:
            return
        try:
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()
        except OSError:
            # The worker died while its last result was on the way: its channel is closed. The unit just
            # handed to it is already booked to it, and xdist reports the worker down next, when
            # remove_node requeues what it had not run. Raising here would end the whole session.
            pass

    def remove_node(self, node: Any) -> str | None:
        crashed, left = left_after_crash(self.assigned_work.pop(node))
        if crashed is None:
            return None
        self.workqueue.update(left)
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: Any, log: Any) -> FileScheduling:
    # the collection order is the schedule (longest files first, tests/file_seconds.py): xdist's own
    # reordering (most tests first) would put the few-test, longest files last
    config.option.loadscopereorder = False
    return FileScheduling(config, log)
