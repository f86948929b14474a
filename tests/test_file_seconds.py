"""The suite's schedule (tests/file_seconds.py): whole files, longest first, from measured seconds."""

from __future__ import annotations

from file_seconds import UNKNOWN_S, file_seconds, load, longest_first, scope_seconds


def test_files_run_longest_first_each_in_its_own_order():
    ids = [
        "tests/a/test_short.py::one",
        "tests/a/test_long.py::one",
        "tests/a/test_short.py::two",
        "tests/a/test_long.py::two[x]",
        "tests/a/test_new.py::one",
    ]
    table = {"tests/a/test_short.py": 1.0, "tests/a/test_long.py": 90.0}
    order = [ids[i] for i in longest_first(ids, table)]
    assert order == [
        "tests/a/test_long.py::one",
        "tests/a/test_long.py::two[x]",
        "tests/a/test_new.py::one",  # unknown: UNKNOWN_S, between the two
        "tests/a/test_short.py::one",
        "tests/a/test_short.py::two",
    ]
    assert scope_seconds(ids, table)["tests/a/test_new.py"] == UNKNOWN_S


def test_the_cluster_files_are_one_unit_with_their_summed_seconds():
    ids = ["tests/cluster/test_x.py::t", "tests/service/test_y.py::t", "tests/cluster/test_z.py::t"]
    table = {
        "tests/cluster/test_x.py": 30.0,
        "tests/cluster/test_z.py": 30.0,
        "tests/service/test_y.py": 50.0,
    }
    assert scope_seconds(ids, table)["tests/cluster"] == 60.0
    assert [ids[i] for i in longest_first(ids, table)] == [ids[0], ids[2], ids[1]]


def test_junit_times_add_up_per_file_classes_included(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_file_seconds" name="a" time="1.25"/>'
        '<testcase classname="tests.test_file_seconds" name="b" time="2.5"/>'
        '<testcase classname="tests.test_file_seconds.SomeClass" name="c" time="0.25"/>'
        "</testsuite></testsuites>"
    )
    assert file_seconds(str(junit)) == {"tests/test_file_seconds.py": 4.0}


def test_the_checked_in_table_has_both_runs():
    tables = load()
    assert set(tables) == {"full", "fast"}
    assert tables["full"] and all(s >= 0 for s in tables["full"].values())
