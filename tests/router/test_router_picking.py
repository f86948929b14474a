"""Replica picking: fewest requests in flight, ties rotated, tried ones excluded, ejected ones last."""

from __future__ import annotations

from vsurge.router.picking import LoadTracker, pick_upstream

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def test_fewest_in_flight_wins() -> None:
    assert pick_upstream([A, B, C], {A: 3, B: 1, C: 2}) == B
    assert pick_upstream([A, B, C], {A: 3, C: 2}) == B  # absent = 0 in flight


def test_ties_rotate_with_the_turn() -> None:
    picks = [pick_upstream([A, B, C], {A: 1}, turn=t) for t in range(4)]
    assert picks == [B, C, B, C]


def test_tried_upstreams_are_excluded_and_none_is_left() -> None:
    assert pick_upstream([A, B], {}, exclude=[A]) == B
    assert pick_upstream([A, B], {}, exclude=[A, B]) is None
    assert pick_upstream([], {}) is None


def test_ejected_upstreams_are_passed_over_unless_all_are() -> None:
    assert pick_upstream([A, B], {B: 5}, ejected={A}) == B
    # Every candidate ejected: try the least loaded anyway rather than fail the request.
    assert pick_upstream([A, B], {B: 5}, ejected={A, B}) == A
    assert pick_upstream([A, B], {}, exclude=[B], ejected={A}) == A


def test_tracker_counts_and_ejections_expire() -> None:
    now = [100.0]
    t = LoadTracker(eject_seconds=10, clock=lambda: now[0])
    t.acquire(A)
    t.acquire(A)
    assert t.pick([A, B]) == B
    t.release(A)
    t.release(A)
    t.release(A)  # an extra release never goes negative
    assert t.in_flight == {}
    t.eject(A)
    assert all(t.pick([A, B]) == B for _ in range(3))
    now[0] += 10.5
    assert t.ejected() == set()
    t.eject(B)
    t.reinstate(B)
    assert t.ejected() == set()
