"""tests/slow_list.py: what `make test-fast` leaves out must name real tests."""

from pathlib import Path

from slow_list import SLOW, stale

ROOT = Path(__file__).resolve().parents[1]


def test_a_renamed_test_is_reported_and_a_live_one_is_not():
    slow = {"tests/a.py::t[x]": "1 s", "tests/a.py::gone": "2 s", "tests/b.py::u": "3 s"}
    assert stale(slow, {"tests/a.py::t[x]", "tests/a.py::other"}) == [
        "tests/a.py::gone"
    ]  # b.py not collected


def test_every_listed_file_exists_and_says_why():
    for nodeid, why in SLOW.items():
        assert (ROOT / nodeid.split("::", 1)[0]).is_file(), nodeid
        assert why.strip(), nodeid
