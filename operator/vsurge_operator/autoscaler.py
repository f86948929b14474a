"""The autoscaling decision, modelled on the Kubernetes HPA (``pkg/controller/podautoscaler``).

Pure: ``decide`` takes the current replica count, one sample per pod, the policy, the history of earlier
recommendations and scale events, and the time; it returns the replica count to set, a reason, and the
new history. The caller keeps the history between calls (and keeps the old one if applying fails).

The steps, as in the HPA:

1. **Recommend** from metrics: ``ceil(current_pods * observed / target)``, no change inside the tolerance.
   Pods that are not ready, or ready pods whose metrics are missing, are filled in pessimistically for the
   direction of the change (0 when scaling up, the target when scaling down), and a fill-in that flips
   the direction means "no change". No metrics at all means "no change".
2. **Stabilize**: scale up only to the lowest recommendation inside the scale-up window, and down only
   to the highest recommendation inside the scale-down window, so a brief dip never removes capacity.
3. **Rate-limit** per period (``scaleUpPods``/``scaleUpPercent``, whichever allows more, and
   ``scaleDownPercent``), counting the changes already made in the period.
4. **Clamp** to ``[minReplicas, maxReplicas]`` — always, also when the metrics say nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vsurge_operator.spec import AutoscalingSpec


@dataclass(frozen=True)
class PodSample:
    """One pod's view: ``value`` is None when it was not scraped or reported nothing."""

    name: str
    ready: bool
    value: float | None


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target: float
    tolerance: float = 0.1
    scale_up_window: float = 0.0
    scale_down_window: float = 300.0
    scale_up_percent: int = 100
    scale_up_pods: int = 4
    scale_down_percent: int = 100
    period: float = 15.0
    metric: str = "slotOccupancy"

    @classmethod
    def from_spec(cls, a: AutoscalingSpec) -> Policy:
        return cls(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            target=a.target,
            tolerance=a.tolerance,
            scale_up_window=a.scale_up_stabilization_seconds,
            scale_down_window=a.scale_down_stabilization_seconds,
            scale_up_percent=a.scale_up_percent,
            scale_up_pods=a.scale_up_pods,
            scale_down_percent=a.scale_down_percent,
            period=a.policy_period_seconds,
            metric=a.metric,
        )


@dataclass(frozen=True)
class History:
    """Recommendations ``(time, replicas)`` and applied changes ``(time, delta)``, oldest first."""

    recommendations: tuple[tuple[float, int], ...] = ()
    events: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: str
    message: str
    value: float | None = None  # mean metric over ready pods that reported one


@dataclass(frozen=True)
class Decision:
    current: int
    replicas: int
    recommended: int
    reason: str
    message: str
    value: float | None
    history: History = field(default_factory=History)

    @property
    def scaled(self) -> bool:
        return self.replicas != self.current


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def recommend(current: int, samples: Sequence[PodSample], policy: Policy) -> Recommendation:
    """Step 1: the replica count the metrics ask for, before stabilization, limits and clamping."""
    ready = [s for s in samples if s.ready]
    values = [s.value for s in ready if s.value is not None]
    missing = len(ready) - len(values)
    unready = len(samples) - len(ready)
    if not values:
        return Recommendation(
            current,
            "NoMetrics",
            f"no ready pod reported {policy.metric} ({len(samples)} pods); keeping {current}",
        )
    usage = _mean(values)
    ratio = usage / policy.target
    observed = f"{policy.metric} {usage:.3g} vs target {policy.target:g} over {len(values)} pods"
    # Not-ready pods only matter when scaling up (they might be starting), as in the HPA.
    if missing == 0 and (unready == 0 or ratio <= 1):
        if abs(ratio - 1) <= policy.tolerance:
            return Recommendation(current, "WithinTolerance", f"{observed}: within tolerance", usage)
        desired = math.ceil(ratio * len(values))
    else:
        filled = list(values)
        if ratio < 1:
            filled += [policy.target] * missing  # a silent pod might be busy: do not count it as idle
        else:
            filled += [0.0] * (missing + unready)  # a silent or starting pod might be idle: dampen scale-up
        new_ratio = _mean(filled) / policy.target
        if abs(new_ratio - 1) <= policy.tolerance or (ratio < 1 < new_ratio) or (new_ratio < 1 < ratio):
            return Recommendation(
                current,
                "IncompleteMetrics",
                f"{observed}; {missing} without metrics and {unready} not ready make the signal too weak",
                usage,
            )
        ratio = new_ratio
        desired = math.ceil(new_ratio * len(filled))
    # Never move against the signal (e.g. fewer pods exist than replicas requested yet).
    if (ratio > 1 and desired < current) or (ratio < 1 and desired > current):
        desired = current
    reason = "ScaleUp" if desired > current else "ScaleDown" if desired < current else "WithinTolerance"
    return Recommendation(desired, reason, f"{observed}: recommend {desired}", usage)


def decide(
    *,
    current: int,
    samples: Sequence[PodSample],
    policy: Policy,
    history: History,
    now: float,
) -> Decision:
    """Steps 1-4; see the module docstring."""
    keep = max(policy.scale_up_window, policy.scale_down_window)
    recs = [(t, r) for t, r in history.recommendations if t > now - keep]
    events = [(t, d) for t, d in history.events if t > now - policy.period]

    if current == 0 and policy.min_replicas == 0:
        # Scaled to zero: no pods to measure. The router wakes the model through the scale subresource.
        return Decision(
            0,
            0,
            0,
            "ScaledToZero",
            "no replicas; waiting for a request to wake the model",
            None,
            History(tuple(recs), tuple(events)),
        )

    if not recs:
        # A fresh start (or an operator restart): act as if the current count was just recommended, so a
        # restart never causes an immediate scale-down.
        recs = [(now, current)]

    rec = recommend(current, samples, policy)
    reason, message = rec.reason, rec.message
    if rec.reason != "NoMetrics":
        recs.append((now, rec.replicas))

    # Step 2: stabilization windows.
    up_floor = min([r for t, r in recs if t > now - policy.scale_up_window] + [rec.replicas])
    down_ceiling = max([r for t, r in recs if t > now - policy.scale_down_window] + [rec.replicas])
    stabilized = min(max(current, up_floor), down_ceiling)
    if stabilized > rec.replicas:
        reason = "ScaleDownStabilized"
        message += (
            f"; holding {stabilized}, the highest recommendation in the last {policy.scale_down_window:g}s"
        )
    elif stabilized < rec.replicas:
        reason = "ScaleUpStabilized"
        message += (
            f"; holding {stabilized}, the lowest recommendation in the last {policy.scale_up_window:g}s"
        )

    # Step 3: rate limits over the current period.
    added = sum(d for _, d in events if d > 0)
    removed = -sum(d for _, d in events if d < 0)
    final = stabilized
    if final > current:
        start = current - added + removed
        limit = max(
            start + policy.scale_up_pods, math.ceil(start * (1 + policy.scale_up_percent / 100)), current
        )
        if final > limit and limit < policy.max_replicas:
            final = limit
            reason = "ScaleUpLimit"
            message += f"; limited to {limit} within {policy.period:g}s"
    elif final < current:
        start = current + removed - added
        limit = min(int(start * (1 - policy.scale_down_percent / 100)), current)
        if final < limit and limit > policy.min_replicas:
            final = limit
            reason = "ScaleDownLimit"
            message += f"; limited to {limit} within {policy.period:g}s"

    # Step 4: the bounds hold whatever the metrics say, also for a count set by hand.
    if final > policy.max_replicas:
        final = policy.max_replicas
        reason = "TooManyReplicas"
        message += f"; clamped to maxReplicas {policy.max_replicas}"
    elif final < policy.min_replicas:
        final = policy.min_replicas
        reason = "TooFewReplicas"
        message += f"; clamped to minReplicas {policy.min_replicas}"

    if final != current:
        events.append((now, final - current))
    return Decision(
        current=current,
        replicas=final,
        recommended=rec.replicas,
        reason=reason,
        message=message,
        value=rec.value,
        history=History(tuple(recs), tuple(events)),
    )


def compact(history: History) -> History:
    """The same decisions from less memory: per replica count only its latest recommendation.

    ``decide`` reads recommendations only as the min and max over windows ending now, and a later equal
    value stays inside any such window longer than an earlier one, so dropping the earlier one changes
    nothing. The history then holds at most one entry per replica count, small enough for the status."""
    latest: dict[int, float] = {}
    for t, r in history.recommendations:
        latest[r] = max(t, latest.get(r, t))
    recs = tuple(sorted((t, r) for r, t in latest.items()))
    return History(recs, tuple(sorted(history.events)))


def merge(a: History, b: History) -> History:
    """Both memories at once (an operator that takes over the model from another one): compacted."""
    return compact(
        History(
            tuple(set(a.recommendations) | set(b.recommendations)),
            tuple(set(a.events) | set(b.events)),
        )
    )


def history_to_status(history: History) -> dict[str, list[list[float]]]:
    """For status.autoscaler.history: times as Unix seconds (ms precision), values as written."""
    h = compact(history)
    return {
        "recommendations": [[round(t, 3), r] for t, r in h.recommendations],
        "events": [[round(t, 3), d] for t, d in h.events],
    }


def history_from_status(raw: object) -> History:
    """Read status.autoscaler.history back; anything malformed is ignored (an empty memory is safe)."""
    if not isinstance(raw, dict):
        return History()

    def pairs(key: str) -> tuple[tuple[float, int], ...]:
        out = []
        for item in raw.get(key) or []:
            if isinstance(item, list | tuple) and len(item) == 2:
                try:
                    out.append((float(item[0]), int(item[1])))
                except (TypeError, ValueError):
                    continue
        return tuple(out)

    return History(pairs("recommendations"), pairs("events"))


def without_last_event(history: History) -> History:
    """History as if the last scale event had not happened (the caller failed to apply it)."""
    return replace(history, events=history.events[:-1])
