"""The autoscaling decision: table-driven single steps, simulated scenarios, and invariants."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vsurge_operator.autoscaler import (
    Decision,
    History,
    PodSample,
    Policy,
    compact,
    decide,
    history_from_status,
    history_to_status,
    merge,
    recommend,
    without_last_event,
)
from vsurge_operator.spec import AutoscalingSpec

BASE = Policy(min_replicas=1, max_replicas=8, target=0.7, tolerance=0.1, scale_down_window=300)
NO_WINDOW = replace(BASE, scale_down_window=0)


def pods(*values: float | None, ready: bool = True) -> list[PodSample]:
    return [PodSample(f"p{i}", ready, v) for i, v in enumerate(values)]


def unready(n: int) -> list[PodSample]:
    return [PodSample(f"u{i}", False, None) for i in range(n)]


# ------------------------------------------------------------------------------------- single steps

STEPS = [
    # (name, policy, current, samples, history, expected replicas, expected reason)
    ("within tolerance", BASE, 2, pods(0.75, 0.75), History(), 2, "WithinTolerance"),
    ("scale up", replace(BASE, target=0.5), 2, pods(1.0, 1.0), History(), 4, "ScaleUp"),
    (
        "scale down held by window after a restart",
        BASE,
        4,
        pods(0.1, 0.1, 0.1, 0.1),
        History(),
        4,
        "ScaleDownStabilized",
    ),
    ("scale down without window", NO_WINDOW, 4, pods(0.1, 0.1, 0.1, 0.1), History(), 1, "ScaleDown"),
    # Missing metrics while going down count as "at target": 3 instead of 1.
    (
        "missing metrics dampen scale-down",
        NO_WINDOW,
        4,
        pods(0.1, 0.1, None, None),
        History(),
        3,
        "ScaleDown",
    ),
    # Missing metrics while going up count as idle: 1.0,1.0,0,0 averages exactly the target.
    (
        "missing metrics dampen scale-up",
        replace(BASE, target=0.5),
        4,
        pods(1.0, 1.0, None, None),
        History(),
        4,
        "IncompleteMetrics",
    ),
    # A starting pod counts as idle when scaling up; here that flips the direction: no change.
    (
        "unready pods dampen scale-up",
        replace(BASE, target=0.5),
        3,
        pods(1.0) + unready(2),
        History(),
        3,
        "IncompleteMetrics",
    ),
    (
        "unready pods ignored when scaling down",
        NO_WINDOW,
        3,
        pods(0.1, 0.1) + unready(1),
        History(),
        1,
        "ScaleDown",
    ),
    ("all metrics missing", BASE, 3, pods(None, None, None), History(), 3, "NoMetrics"),
    ("no ready pods", BASE, 3, unready(3), History(), 3, "NoMetrics"),
    ("no pods at all", BASE, 2, [], History(), 2, "NoMetrics"),
    ("above max without metrics", BASE, 10, pods(None), History(), 8, "TooManyReplicas"),
    ("above max within tolerance", BASE, 10, pods(*[0.7] * 10), History(), 8, "TooManyReplicas"),
    ("below min", replace(BASE, min_replicas=2), 0, [], History(), 2, "TooFewReplicas"),
    ("scaled to zero stays at zero", replace(BASE, min_replicas=0), 0, [], History(), 0, "ScaledToZero"),
    ("idle scales to zero", replace(NO_WINDOW, min_replicas=0), 2, pods(0.0, 0.0), History(), 0, "ScaleDown"),
    (
        "scale-up rate limit",
        replace(BASE, target=0.1, max_replicas=50),
        2,
        pods(1.0, 1.0),
        History(),
        6,
        "ScaleUpLimit",
    ),
    (
        "scale-up limited by earlier changes in the period",
        replace(BASE, target=0.1, max_replicas=50),
        6,
        pods(*[1.0] * 6),
        History(events=((95.0, 4),)),
        6,
        "ScaleUpLimit",
    ),
    (
        "scale-up limit counts percent",
        replace(BASE, target=0.1, max_replicas=50, scale_up_pods=1),
        10,
        pods(*[1.0] * 10),
        History(),
        20,
        "ScaleUpLimit",
    ),
    (
        "scale-down rate limit",
        replace(NO_WINDOW, scale_down_percent=50),
        8,
        pods(*[0.05] * 8),
        History(),
        4,
        "ScaleDownLimit",
    ),
    (
        "scale-up window keeps the lowest recent recommendation",
        replace(BASE, target=0.5, scale_up_window=60),
        2,
        pods(1.0, 1.0),
        History(recommendations=((70.0, 2),)),
        2,
        "ScaleUpStabilized",
    ),
    (
        "max clamp wins over the recommendation",
        replace(BASE, target=0.1),
        6,
        pods(*[1.0] * 6),
        History(),
        8,
        "TooManyReplicas",
    ),
]


@pytest.mark.parametrize(
    ("name", "policy", "current", "samples", "history", "replicas", "reason"),
    STEPS,
    ids=[s[0] for s in STEPS],
)
def test_single_decision(name, policy, current, samples, history, replicas, reason):
    d = decide(current=current, samples=samples, policy=policy, history=history, now=100.0)
    assert (d.replicas, d.reason) == (replicas, reason), d.message
    assert d.scaled == (replicas != current)
    # The change is recorded for the rate limits of the next period.
    assert (d.history.events[-1:] == ((100.0, replicas - current),)) == d.scaled


def test_recommendation_reports_the_mean_of_ready_pods():
    r = recommend(2, pods(0.6, 1.0) + unready(1), replace(BASE, target=0.5))
    assert r.value == pytest.approx(0.8)
    assert "slotOccupancy 0.8" in r.message


def test_failed_apply_forgets_only_the_event():
    d = decide(current=2, samples=pods(1.0, 1.0), policy=replace(BASE, target=0.5), history=History(), now=10)
    kept = without_last_event(d.history)
    assert kept.events == () and kept.recommendations == d.history.recommendations


# ---------------------------------------------------------------------------------- simulated time


def simulate(
    policy: Policy,
    load: Callable[[float], float],
    seconds: float,
    interval: float = 15,
    start: int = 1,
    saturate: bool = True,
) -> list[tuple[float, int, Decision]]:
    """Every pod sees ``load / replicas`` (capped at 1 for occupancy) and the decision is applied at once."""
    replicas, history, out = start, History(), []
    t = 0.0
    while t <= seconds:
        per_pod = load(t) / replicas if replicas else 0.0
        value = min(1.0, per_pod) if saturate else per_pod
        d = decide(current=replicas, samples=pods(*[value] * replicas), policy=policy, history=history, now=t)
        history, replicas = d.history, d.replicas
        out.append((t, replicas, d))
        t += interval
    return out


def test_spike_scales_up_at_once_and_stops_at_max():
    trace = simulate(BASE, lambda t: 0.5 if t < 60 else 10.0, seconds=300)
    before = [r for t, r, _ in trace if t < 60]
    after = [r for t, r, _ in trace if t >= 60]
    assert set(before) == {1}
    assert after[0] == 2, "the first pass after the spike must already scale up (no up window)"
    assert after == sorted(after), "monotonic while the load stays high"
    assert 8 in after[:5] and max(after) == 8
    assert trace[-1][2].reason == "TooManyReplicas" and trace[-1][2].recommended == 12


def test_unbounded_metric_spike_is_rate_limited_per_period():
    policy = replace(BASE, metric="prefillQueueSize", target=2, max_replicas=20)
    trace = simulate(policy, lambda t: 200.0, seconds=30, interval=5, saturate=False)
    replicas = [r for _, r, _ in trace]
    # +4 pods (or +100 %) per 15 s period, whichever is more: 1 -> 5, held within the period, then 10, 20.
    assert replicas == [5, 5, 5, 10, 10, 10, 20]
    assert trace[1][2].reason == "ScaleUpLimit"


def test_slow_decline_steps_down_only_to_the_highest_recent_recommendation():
    def load(t: float) -> float:  # 5.6 -> 0.35 over 20 minutes, then flat
        return max(0.35, 5.6 - 5.25 * t / 1200)

    trace = simulate(BASE, load, seconds=2400, start=8)
    replicas = [r for _, r, _ in trace]
    assert replicas == sorted(replicas, reverse=True), "a declining load never scales up"
    assert replicas[-1] == 1
    for i, (t, r, _) in enumerate(trace):
        window = [d.recommended for tt, _, d in trace[: i + 1] if tt > t - 300]
        assert r == min(8, max(1, max(window))), t
    # It lags the load: at any time, at least what was needed 5 minutes ago (to within the tolerance).
    for t, r, _ in trace:
        if t >= 300:
            assert r >= math.ceil(load(t - 300 + 15) / 0.7 / 1.1) - 1


def test_flapping_load_does_not_flap_replicas():
    def load(t: float) -> float:
        if t >= 900:
            return 0.3  # the flapping stops
        return 3.0 if (t // 15) % 2 else 0.3

    trace = simulate(BASE, load, seconds=1800)
    during = [r for t, r, _ in trace if 15 <= t < 900]
    assert during == sorted(during), "never scales down while the load keeps coming back"
    changes = sum(1 for a, b in zip(during, during[1:], strict=False) if a != b)
    assert changes <= 3
    settled = [r for t, r, _ in trace if t >= 900 + 300 + 15]
    assert settled and set(settled) == {1}, "scales down once the window has seen no high load"
    assert not any(r < max(during) for t, r, _ in trace if 900 <= t < 900 + 300 - 15)


def test_all_metrics_missing_over_time_keeps_replicas():
    policy = BASE
    history, replicas = History(), 3
    for t in range(0, 600, 15):
        d = decide(current=replicas, samples=pods(None, None, None), policy=policy, history=history, now=t)
        history, replicas = d.history, d.replicas
        assert (replicas, d.reason) == (3, "NoMetrics")
    assert history.events == ()


def test_policy_from_spec_maps_every_field():
    spec = AutoscalingSpec(
        enabled=True,
        min_replicas=2,
        max_replicas=9,
        metric="prefillQueueSize",
        target=3.0,
        tolerance=0.2,
        interval_seconds=5,
        scale_up_stabilization_seconds=10,
        scale_down_stabilization_seconds=20,
        scale_up_percent=50,
        scale_up_pods=2,
        scale_down_percent=30,
        policy_period_seconds=40,
    )
    assert Policy.from_spec(spec) == Policy(
        min_replicas=2,
        max_replicas=9,
        target=3.0,
        tolerance=0.2,
        scale_up_window=10,
        scale_down_window=20,
        scale_up_percent=50,
        scale_up_pods=2,
        scale_down_percent=30,
        period=40,
        metric="prefillQueueSize",
    )


# ---------------------------------------------------------------------------------------- invariants

policies = st.builds(
    lambda lo, span, target, up, down, pct, pods_, dpct: Policy(
        min_replicas=lo,
        max_replicas=lo + span,
        target=target,
        scale_up_window=up,
        scale_down_window=down,
        scale_up_percent=pct,
        scale_up_pods=pods_,
        scale_down_percent=dpct,
    ),
    st.integers(0, 5),
    st.integers(0, 10),
    st.floats(0.05, 1.0),
    st.integers(0, 120),
    st.integers(0, 600),
    st.integers(1, 300),
    st.integers(1, 10),
    st.integers(1, 100),
)
samples_st = st.lists(
    st.builds(
        PodSample, st.text(min_size=1, max_size=3), st.booleans(), st.one_of(st.none(), st.floats(0, 1.0))
    ),
    max_size=12,
)
histories = st.builds(
    History,
    st.lists(st.tuples(st.floats(0, 1000), st.integers(0, 30)), max_size=6).map(lambda xs: tuple(sorted(xs))),
    st.lists(st.tuples(st.floats(900, 1000), st.integers(-5, 5)), max_size=4).map(
        lambda xs: tuple(sorted(xs))
    ),
)


@settings(max_examples=300, deadline=None)
@given(policy=policies, current=st.integers(0, 20), samples=samples_st, history=histories)
def test_decision_is_always_within_bounds(policy, current, samples, history):
    d = decide(current=current, samples=samples, policy=policy, history=history, now=1000.0)
    if current == 0 and policy.min_replicas == 0:
        assert d.replicas == 0
    else:
        assert policy.min_replicas <= d.replicas <= policy.max_replicas
    if not any(s.ready and s.value is not None for s in samples):
        # Without metrics, only the bounds may move the count.
        assert d.replicas == min(policy.max_replicas, max(policy.min_replicas, current)) or current == 0
    assert len(d.history.events) <= len(history.events) + 1


# ------------------------------------------------------------------ the history kept in the status


@settings(max_examples=200, deadline=None)
@given(
    policy=policies,
    start=st.integers(1, 8),
    steps=st.lists(
        st.tuples(st.floats(1, 40), st.lists(st.floats(0, 1.0), min_size=1, max_size=8)), max_size=25
    ),
)
def test_compacted_history_makes_the_same_decisions(policy, start, steps):
    """What another operator replica reads back from the status decides exactly as the full memory."""
    full = small = History()
    current_full = current_small = start
    now = 1000.0
    for gap, values in steps:
        now += gap
        samples = pods(*values)
        a = decide(current=current_full, samples=samples, policy=policy, history=full, now=now)
        b = decide(current=current_small, samples=samples, policy=policy, history=small, now=now)
        assert (a.replicas, a.reason) == (b.replicas, b.reason)
        full, current_full = a.history, a.replicas
        small, current_small = compact(b.history), b.replicas
        # At most one recommendation per replica count survives: the status stays small.
        assert len({r for _, r in small.recommendations}) == len(small.recommendations)


def test_history_round_trips_through_the_status_and_merges():
    h = History(((10.0, 3), (20.5, 4), (30.25, 3)), ((20.5, 1),))
    stored = history_to_status(h)
    assert stored == {"recommendations": [[20.5, 4], [30.25, 3]], "events": [[20.5, 1]]}
    assert history_from_status(stored) == compact(h)
    # Malformed input is ignored, never fatal (an empty memory is the cautious default).
    assert history_from_status({"recommendations": [["x", 1], [1]], "events": None}) == History()
    assert history_from_status("garbage") == History()
    mine = History(((40.0, 5),), ())
    assert merge(mine, history_from_status(stored)) == History(
        ((20.5, 4), (30.25, 3), (40.0, 5)), ((20.5, 1),)
    )
