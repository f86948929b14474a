"""`make test`'s worker scheduler (tests/xdist_files.py): a worker that dies mid-file costs that one test,
not the run. xdist 3.8's own file scheduler hangs there until CI's time limit."""

import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

from xdist_files import FileScheduling, left_after_crash, scope_of


def test_a_crash_requeues_only_the_tests_not_yet_run():
    workload = {
        "tests/test_a.py": {"tests/test_a.py::one": True, "tests/test_a.py::two": True},
        "tests/test_b.py": {
            "tests/test_b.py::one": True,
            "tests/test_b.py::dies": False,
            "tests/test_b.py::after": False,
        },
        "tests/test_c.py": {"tests/test_c.py::one": False},
    }
    crashed, left = left_after_crash(workload)
    assert crashed == "tests/test_b.py::dies"
    assert left == {
        "tests/test_b.py": {"tests/test_b.py::after": False},
        "tests/test_c.py": {"tests/test_c.py::one": False},
    }
    assert left_after_crash({"tests/test_a.py": {"tests/test_a.py::one": True}}) == (None, {})


def test_the_cluster_suite_is_one_unit():
    assert scope_of("tests/cluster/test_x.py::t") == scope_of("tests/cluster/test_y.py::u") == "tests/cluster"
    assert scope_of("tests/service/test_x.py::t[1]") == "tests/service/test_x.py"


class _ClosedWorker:
    """A worker whose channel closed: it died after its last result reached the controller."""

    shutting_down = False

    def send_runtest_some(self, indices):
        raise OSError("cannot send (already closed?)")

    def shutdown(self):
        raise OSError("cannot send (already closed?)")


def test_work_for_a_worker_that_just_died_goes_back_when_it_is_reported_down():
    # the race the real-session test below hits one run in five on a loaded machine: a result arrives,
    # the scheduler tops the worker up, and the send meets a closed channel
    sched = FileScheduling.__new__(FileScheduling)
    node = _ClosedWorker()
    sched.assigned_work = {node: {"t/b.py": {"t/b.py::ok": True, "t/b.py::dies": False}}}
    sched.registered_collections = {node: ["t/b.py::ok", "t/b.py::dies", "t/c.py::x"]}
    sched.workqueue = OrderedDict({"t/c.py": {"t/c.py::x": False}})
    sched._reschedule(node)  # must not raise: that ended the whole session with INTERNALERROR
    assert sched.assigned_work[node]["t/c.py"] == {"t/c.py::x": False}
    assert sched.remove_node(node) == "t/b.py::dies"
    assert dict(sched.workqueue) == {"t/c.py": {"t/c.py::x": False}}


def test_a_worker_that_dies_fails_its_test_and_the_rest_still_run(tmp_path: Path):
    (tmp_path / "test_1_fine.py").write_text("def test_first():\n    pass\n")
    (tmp_path / "test_2_dies.py").write_text(
        textwrap.dedent(
            """
            import os

            def test_before():
                pass

            def test_dies():
                os._exit(3)

            def test_after():
                pass
            """
        )
    )
    (tmp_path / "test_3_fine.py").write_text("def test_last():\n    pass\n")
    here = Path(__file__).resolve().parent
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "1",
            "-p",
            "xdist_files",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=0",
            "--rootdir",
            str(tmp_path),
            "-c",
            "/dev/null",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(here)},
        capture_output=True,
        text=True,
        timeout=180,  # xdist's own scheduler never returns here
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 4 passed" in out, out
    assert "test_dies" in out, out
