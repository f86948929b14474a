"""Consistent hashing with bounded loads, as pure functions (hypothesis): the bound is never exceeded,
a key stays on its pod while that pod is under the bound, and a removed pod moves only its own keys."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vsurge.router.hashring import HashRing, bounded_pick, load_bound

PODS = [f"http://10.0.0.{i}:11556" for i in range(1, 9)]
pods_st = st.lists(st.sampled_from(PODS), min_size=1, max_size=8, unique=True)
keys_st = st.lists(st.binary(min_size=1, max_size=24), min_size=1, max_size=60)
eps_st = st.sampled_from([0.01, 0.1, 0.25, 0.5, 1.0, 3.0])


def test_load_bound_is_the_ceiling_of_1_plus_eps_times_the_mean() -> None:
    assert load_bound(0, 4, 0.25) == 1  # ceil(1.25 * 1 / 4)
    assert load_bound(7, 4, 0.25) == 3  # ceil(1.25 * 8 / 4) = ceil(2.5)
    assert load_bound(11, 4, 0.25) == 4  # ceil(1.25 * 12 / 4) = 3.75 -> 4
    assert load_bound(3, 4, 1.0) == 2  # exactly 2.0 stays 2
    with pytest.raises(ValueError):
        load_bound(1, 0, 0.25)


@settings(max_examples=150, deadline=None)
@given(
    pods=pods_st,
    ops=st.lists(st.tuples(st.binary(min_size=1, max_size=8), st.booleans()), max_size=80),
    eps=eps_st,
)
def test_no_pod_is_ever_above_the_bound(pods: list[str], ops: list[tuple[bytes, bool]], eps: float) -> None:
    """Requests arrive (and some finish) in any order: every placement keeps its pod within
    ceil((1 + eps) * (L + 1) / n), so no pod ever holds more than (1 + eps) times the mean plus one."""
    ring = HashRing(pods, vnodes=40)
    loads = dict.fromkeys(pods, 0)
    placed: list[str] = []
    for key, finish_one in ops:
        if finish_one and placed:
            loads[placed.pop(0)] -= 1
            continue
        bound = load_bound(sum(loads.values()), len(pods), eps)
        pod = bounded_pick(ring, key, loads, eps)
        assert pod in pods
        loads[pod] += 1
        placed.append(pod)
        assert loads[pod] <= bound


@settings(max_examples=150, deadline=None)
@given(pods=pods_st, keys=keys_st, eps=eps_st)
def test_after_any_arrivals_no_pod_holds_more_than_1_plus_eps_times_the_mean(
    pods: list[str], keys: list[bytes], eps: float
) -> None:
    ring = HashRing(pods, vnodes=40)
    loads = dict.fromkeys(pods, 0)
    for key in keys:
        loads[bounded_pick(ring, key, loads, eps)] += 1
    total = sum(loads.values())
    assert max(loads.values()) <= load_bound(total - 1, len(pods), eps)  # ceil((1 + eps) * total / n)


@settings(max_examples=150, deadline=None)
@given(pods=pods_st, keys=keys_st, eps=eps_st, data=st.data())
def test_a_key_stays_on_its_pod_while_that_pod_is_under_the_bound(
    pods: list[str], keys: list[bytes], eps: float, data: st.DataObject
) -> None:
    ring = HashRing(pods, vnodes=40)
    loads = {p: data.draw(st.integers(0, 6)) for p in pods}
    bound = load_bound(sum(loads.values()), len(pods), eps)
    for key in keys:
        owner = ring.owner(key)
        pick = bounded_pick(ring, key, loads, eps)
        assert pick == bounded_pick(ring, key, dict(loads), eps)  # a pure function of its inputs
        if loads[owner] + 1 <= bound:
            assert pick == owner
        else:  # spilled: to the first pod clockwise that has room, the same one every time
            assert pick != owner and loads[pick] + 1 <= bound
            before = list(ring.walk(key))
            assert all(loads[p] + 1 > bound for p in before[: before.index(pick)])


@settings(max_examples=150, deadline=None)
@given(
    pods=st.lists(st.sampled_from(PODS), min_size=2, max_size=8, unique=True), keys=keys_st, data=st.data()
)
def test_a_removed_pod_moves_only_its_keys(pods: list[str], keys: list[bytes], data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(pods))
    left = [p for p in pods if p != gone]
    full, smaller = HashRing(pods, vnodes=40), HashRing(left, vnodes=40)
    idle = dict.fromkeys(pods, 0)
    for key in keys:
        before = bounded_pick(full, key, idle, 0.25)
        after = bounded_pick(smaller, key, idle, 0.25)
        if before != gone:
            assert after == before
        else:
            assert after in left
    # The same through `candidates` (how the picker drops an ejected pod without a new ring).
    for key in keys:
        before = bounded_pick(full, key, idle, 0.25)
        after = bounded_pick(full, key, idle, 0.25, candidates=set(left))
        assert after == (before if before != gone else smaller.owner(key))


def test_keys_spread_evenly_over_the_pods() -> None:
    ring = HashRing(PODS[:4])
    owners = Counter(ring.owner(f"system-prompt-{i}".encode()) for i in range(4000))
    assert set(owners) == set(PODS[:4])
    assert all(700 <= n <= 1300 for n in owners.values()), owners


def test_a_hot_key_spills_in_ring_order_and_comes_back() -> None:
    ring = HashRing(PODS[:3], vnodes=40)
    key = b"one very popular system prompt"
    order = list(ring.walk(key))
    loads = dict.fromkeys(PODS[:3], 0)
    picks = []
    for _ in range(9):
        pod = bounded_pick(ring, key, loads, 0.25)
        loads[pod] += 1
        picks.append(pod)
    assert picks[0] == order[0]
    assert max(loads.values()) <= 4  # ceil(1.25 * 9 / 3) = 4
    assert set(picks) == set(order)  # spilled to the next pods on the ring
    loads = dict.fromkeys(PODS[:3], 0)  # the load is gone: back to its own pod
    assert bounded_pick(ring, key, loads, 0.25) == order[0]
    assert bounded_pick(ring, key, loads, 0.25, candidates=()) is None
