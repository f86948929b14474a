"""Pod picking (pure): by load (the router's in-flight counts corrected by what /load reports), ties rotated,
tried ones excluded, ejected and draining ones last; the prefix policy's index and ring."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vsurge.router.hashring import HashRing
from vsurge.router.load_picking import (
    LoadReport,
    LoadTracker,
    estimated_load,
    parse_load,
    pick_least_load,
    pick_round_robin,
    pick_upstream,
    pressure,
    usable,
)
from vsurge.router.loadpoll import LoadBook
from vsurge.router.policies import Picker, PrefixIndex, prefix_decision

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


# ------------------------------------------------------------------------------------- load reports


def _report(
    waiting: int = 0, running: int = 0, slots: int = 4, kv: float = 0.0, then: int = 0, status: str = "ready"
):
    return LoadReport(
        at=0.0,
        status=status,
        waiting=waiting,
        running=running,
        slots_total=slots,
        kv_usage=kv,
        in_flight_then=then,
    )


def test_load_is_the_report_corrected_by_the_routers_own_traffic_since() -> None:
    r = _report(waiting=2, running=3, then=1)  # 5 on the pod, 1 of them ours when it reported
    assert estimated_load(1, r) == 5
    assert estimated_load(4, r) == 8  # we sent 3 more since
    assert estimated_load(0, r) == 4  # ours finished since
    assert estimated_load(0, _report(then=3)) == 0  # never below zero
    assert estimated_load(6, _report(running=1, then=0)) == 7
    assert estimated_load(2, None) == 2  # no report: what we know


def test_headroom_is_the_tighter_of_slots_and_kv_pages() -> None:
    assert pressure(0, _report(running=2, slots=4)) == 0.5
    assert pressure(0, _report(running=1, slots=4, kv=0.9)) == 0.9  # KV nearly full beats free slots
    assert pressure(0, _report(waiting=4, running=4, slots=4)) == 2.0  # a queue counts beyond the slots
    # The pod with the most headroom wins; slots differ between pods.
    reports = {
        A: _report(running=3, slots=4),
        B: _report(running=3, slots=16),
        C: _report(running=1, slots=4, kv=0.8),
    }
    assert pick_least_load([A, B, C], {}, reports) == B
    # Without a report for every candidate, in-flight counts decide, as before /load.
    assert pick_least_load([A, B, C], {B: 2, C: 1}, {A: _report(running=9)}) == A


def test_equal_headroom_rotates() -> None:
    reports = {u: _report(running=1) for u in (A, B, C)}
    assert [pick_least_load([A, B, C], {}, reports, turn=t) for t in range(3)] == [A, B, C]
    assert pick_round_robin([A, B, C], turn=4) == B and pick_round_robin([], turn=1) is None


def test_parse_load_reads_the_servers_report_and_refuses_others() -> None:
    body = {
        "server_load": 3,
        "status": "draining",
        "requests_waiting": 1,
        "requests_running": 2,
        "slots_total": 8,
        "kv_usage": 0.25,
        "models": {"m": {"driver": "odriver"}, "bad": "x"},
    }
    r = parse_load(body, at=5.0, in_flight_then=2)
    assert r == LoadReport(5.0, "draining", 1, 2, 8, 0.25, 2, {"m": "odriver"}) and not r.ready
    assert parse_load({"detail": "Not Found"}, at=0, in_flight_then=0) is None
    assert parse_load([1], at=0, in_flight_then=0) is None
    odd = parse_load(
        {"status": "ready", "requests_waiting": -3, "slots_total": True, "kv_usage": 7},
        at=0,
        in_flight_then=0,
    )
    assert (odd.waiting, odd.slots_total, odd.kv_usage) == (0, 0, 1.0)


@settings(max_examples=200, deadline=None)
@given(
    body=st.recursive(
        st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=True) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=16), inner, max_size=6),
        max_leaves=20,
    )
)
def test_parse_load_never_raises_on_any_json(body: object) -> None:
    r = parse_load(body, at=0.0, in_flight_then=0)
    if r is not None:
        assert min(r.waiting, r.running, r.slots_total) >= 0 and 0.0 <= r.kv_usage <= 1.0


# --------------------------------------------------------------------------------- the prefix policy


def test_prefix_decision_follows_the_deepest_block_seen_under_the_bound() -> None:
    hashes = [bytes([i]) * 16 for i in range(6)]
    ring = HashRing([A, B, C], vnodes=40)
    idle = dict.fromkeys([A, B, C], 0)
    # Nothing seen yet: the ring decides, by the key block (the 2nd here).
    pod, how = prefix_decision(
        hashes, [A, B, C], idle, eps=0.25, key_blocks=2, index=PrefixIndex(), ring=ring
    )
    assert how == "prefix_hash" and pod == ring.owner(hashes[1])
    # A conversation that went elsewhere earlier (its blocks 0-4 on `other`): followed, if as deep as the key.
    other = next(p for p in (A, B, C) if p != pod)
    index = PrefixIndex()
    index.record(hashes[:5], other)
    assert prefix_decision(hashes, [A, B, C], idle, eps=0.25, key_blocks=2, index=index, ring=ring) == (
        other,
        "prefix_match",
    )
    # A match shallower than the key (only block 0 was seen there) does not outweigh the ring.
    shallow = PrefixIndex()
    shallow.record(hashes[:1], other)
    assert prefix_decision(hashes, [A, B, C], idle, eps=0.25, key_blocks=2, index=shallow, ring=ring)[1] == (
        "prefix_hash"
    )
    # Over the bound, the match is passed over.
    busy = {**idle, other: 5}
    got, how = prefix_decision(hashes, [A, B, C], busy, eps=0.25, key_blocks=2, index=index, ring=ring)
    assert got != other and how == "prefix_hash"
    # A prompt without a full block has nothing to share.
    assert prefix_decision([], [A, B, C], idle, eps=0.25, key_blocks=2, index=index, ring=ring) is None


def test_prefix_index_is_bounded_and_forgets_gone_pods() -> None:
    index = PrefixIndex(capacity=3, per_block=2)
    index.record([b"1", b"2"], A)
    index.record([b"3", b"4"], B)
    assert len(index) == 3 and index.get(b"1") == () and index.get(b"2") == (A,)
    index.record([b"2"], B)
    index.record([b"2"], C)
    assert index.get(b"2") == (B, C)  # the two most recent holders, most recent last
    index.forget({C})
    assert index.get(b"2") == (B,) and index.get(b"4") == (B,)


def test_a_prompt_held_by_several_pods_goes_to_the_least_loaded_holder() -> None:
    hashes = [bytes([i]) * 16 for i in range(4)]
    ring = HashRing([A, B, C], vnodes=40)
    index = PrefixIndex()
    index.record(hashes[:3], A)
    index.record(hashes[:3], B)  # the system prompt spilled to B once: both hold it
    loads = {A: 1, B: 0, C: 0}
    assert prefix_decision(hashes, [A, B, C], loads, eps=0.25, key_blocks=2, index=index, ring=ring) == (
        B,
        "prefix_match",
    )
    loads = {A: 0, B: 2, C: 0}
    assert prefix_decision(hashes, [A, B, C], loads, eps=0.25, key_blocks=2, index=index, ring=ring)[0] == A


def test_the_picker_resolves_auto_by_the_driver_the_pods_report() -> None:
    book = LoadBook(stale_after=10, clock=lambda: 0.0)
    picker = Picker(LoadTracker(), book)
    assert picker.policy_for("m", [A, B]) == "least-load"  # nothing reported yet
    book.put(A, LoadReport(0.0, "ready", 0, 0, 4, 0.0, 0, {"m": "odriver"}))
    assert picker.policy_for("m", [A, B]) == "prefix" and picker.policy_for("other", [A]) == "least-load"
    assert Picker(LoadTracker(), book, routing="round-robin").policy_for("m", [A]) == "round-robin"
    # A draining pod is avoided while another is left.
    book.put(B, LoadReport(0.0, "draining", 0, 0, 4, 0.0, 0, {"m": "odriver"}))
    assert {picker.pick("m", [A, B], [b"k" * 16]).upstream for _ in range(5)} == {A}
    assert picker.pick("m", [A, B], exclude=[A]).upstream == B  # the last one left is tried anyway


pods_st = st.lists(
    st.sampled_from([A, B, C, "http://d:1", "http://e:1"]), min_size=1, max_size=5, unique=True
)
report_st = st.builds(
    LoadReport,
    at=st.just(0.0),
    status=st.sampled_from(["ready", "draining"]),
    waiting=st.integers(0, 20),
    running=st.integers(0, 20),
    slots_total=st.integers(0, 16),
    kv_usage=st.floats(0, 1),
    in_flight_then=st.integers(0, 10),
)


@settings(max_examples=300, deadline=None)
@given(pods=pods_st, data=st.data(), turn=st.integers(0, 100))
def test_the_pick_is_a_candidate_with_the_most_headroom(
    pods: list[str], data: st.DataObject, turn: int
) -> None:
    in_flight = {p: data.draw(st.integers(0, 10)) for p in pods}
    reports = {p: data.draw(report_st) for p in pods if data.draw(st.booleans())}
    chosen = pick_least_load(pods, in_flight, reports, turn=turn)
    assert chosen in pods
    if len(reports) == len(pods):
        assert pressure(in_flight[chosen], reports[chosen]) == min(
            pressure(in_flight[p], reports[p]) for p in pods
        )
    else:  # any pod without a fresh report: the router's own counts decide
        assert in_flight[chosen] == min(in_flight.values())
    # Tried pods are never picked again; avoided ones only when nothing else is left.
    tried = data.draw(st.lists(st.sampled_from(pods), unique=True))
    avoid = data.draw(st.lists(st.sampled_from(pods), unique=True))
    left = usable(pods, exclude=tried, avoid=avoid)
    assert not set(left) & set(tried)
    assert set(left) == (
        {p for p in pods if p not in tried and p not in avoid} or {p for p in pods if p not in tried}
    )
