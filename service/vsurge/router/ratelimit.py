"""Per-tenant rate limits: token buckets for requests per second and tokens per minute.

Requests: a bucket of `burst` requests refilled at `requestsPerSecond`; a request takes one or is refused.
Tokens: a bucket of `tokensPerMinute` refilled at that rate, charged after the answer with the tokens its
`usage` reports (prompt + completion: both cost the engine), since no one knows the count before. A
request is admitted while the bucket is not empty, so one large answer can drive it below zero; the next
requests then wait until it has refilled above zero. Refusals say when to come back (`Retry-After`).

Buckets live per tenant in one router replica. With N routers behind a Service, each enforces 1/N of
every limit (`--tenant-limit-replicas N`, which the chart sets to `router.replicas`): the Service spreads
a tenant's connections over the replicas, so together they admit about the limit, never more than it. A
tenant whose traffic lands unevenly (few long-lived connections) gets less than the limit; a shared store
would lift that at the cost of a network call in every request's path. Without the flag (N = 1) a tenant
gets up to N times its limits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .tenants import Tenant


@dataclass
class TokenBucket:
    rate: float  # refill per second
    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = max(self.updated, now)

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` can be taken (0: now)."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate


@dataclass(frozen=True)
class Refusal:
    limit: str  # "requests" or "tokens"
    retry_after: float  # seconds
    message: str


@dataclass
class _TenantBuckets:
    tenant: Tenant
    requests: TokenBucket | None
    tokens: TokenBucket | None


def _same_limits(a: Tenant, b: Tenant) -> bool:
    return (a.requests_per_second, a.burst, a.tokens_per_minute) == (
        b.requests_per_second,
        b.burst,
        b.tokens_per_minute,
    )


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, replicas: int = 1) -> None:
        self.clock = clock
        self.share = 1.0 / max(1, replicas)  # this replica's part of every limit
        self._buckets: dict[str, _TenantBuckets] = {}

    def _for(self, tenant: Tenant) -> _TenantBuckets:
        b = self._buckets.get(tenant.name)
        if b is not None and _same_limits(b.tenant, tenant):
            return b
        # New tenant, or its limits changed in the file: fresh, full buckets.
        now = self.clock()
        requests = tokens = None
        if tenant.requests_per_second:
            rate = tenant.requests_per_second * self.share
            burst = max(1.0, (tenant.burst or max(1.0, tenant.requests_per_second)) * self.share)
            requests = TokenBucket(rate, burst, burst, now)
        if tenant.tokens_per_minute:
            per_minute = tenant.tokens_per_minute * self.share
            tokens = TokenBucket(per_minute / 60.0, per_minute, per_minute, now)
        b = self._buckets[tenant.name] = _TenantBuckets(tenant, requests, tokens)
        return b

    def admit(self, tenant: Tenant) -> Refusal | None:
        """Take one request from the tenant's buckets, or say why not and for how long."""
        b = self._for(tenant)
        now = self.clock()
        if b.tokens is not None:
            b.tokens.refill(now)
            if b.tokens.level < 1:
                wait = b.tokens.wait_for(1)
                return Refusal(
                    "tokens",
                    wait,
                    f"Rate limit reached for tenant `{tenant.name}` on tokens per minute: limit "
                    f"{tenant.tokens_per_minute:g}. Please try again in {_human(wait)}.",
                )
        if b.requests is not None:
            b.requests.refill(now)
            if b.requests.level < 1:
                wait = b.requests.wait_for(1)
                return Refusal(
                    "requests",
                    wait,
                    f"Rate limit reached for tenant `{tenant.name}` on requests per second: limit "
                    f"{tenant.requests_per_second:g}. Please try again in {_human(wait)}.",
                )
            b.requests.level -= 1
        return None

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Take the tokens an answer used from the tenant's token bucket (it may go below zero)."""
        b = self._for(tenant)
        if b.tokens is not None and tokens > 0:
            b.tokens.refill(self.clock())
            b.tokens.level -= tokens

    def headers(self, tenant: Tenant) -> Mapping[str, str]:
        """OpenAI's x-ratelimit-* headers for the tenant's current state (empty without limits)."""
        b = self._for(tenant)
        now = self.clock()
        out: dict[str, str] = {}
        for kind, bucket in (("requests", b.requests), ("tokens", b.tokens)):
            if bucket is None:
                continue
            bucket.refill(now)
            out[f"x-ratelimit-limit-{kind}"] = f"{bucket.capacity:g}"
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
            full = (bucket.capacity - bucket.level) / bucket.rate if bucket.level < bucket.capacity else 0.0
            out[f"x-ratelimit-reset-{kind}"] = _human(full)
        return out


def _human(seconds: float) -> str:
    """OpenAI's duration style: 120ms, 1.5s, 2m3s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"
