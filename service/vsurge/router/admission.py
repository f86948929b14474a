"""Who may send a request, for which model, and how often: the tenants' gate in front of the proxy.

Without `--api-keys-file` the gate is open: no key is asked for, and the client's `Authorization` header
goes to the pod untouched (a pod may check its own `--api-key`). With it: every API route (the model list
included) needs `Authorization: Bearer <key>` of a known tenant (401 otherwise, before the body is even
read, so an unauthenticated client cannot wake a model), a tenant sees and uses only its models (others
are 404, as if they did not exist), its limits answer 429 with Retry-After, and the router's key is not
forwarded to the pod. Tokens are charged from each answer's usage (usage.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from . import errors
from .metrics import RouterMetrics
from .ratelimit import RateLimiter
from .tenants import ApiKeys, Tenant, bearer_token
from .usage import Usage


class Gate:
    def __init__(self, keys: ApiKeys | None, limiter: RateLimiter, metrics: RouterMetrics) -> None:
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def authenticate(self, headers: Mapping[str, str]) -> Tenant | Response | None:
        """The tenant of the request (None when the gate is open), or the 401 to answer."""
        if self.keys is None:
            return None
        token = bearer_token(headers.get("authorization"))
        if token is None:
            self.metrics.auth_failures.labels("missing").inc()
            return errors.unauthorized(missing=True)
        tenant = self.keys.ring.authenticate(token)
        if tenant is None:
            self.metrics.auth_failures.labels("invalid").inc()
            return errors.unauthorized(missing=False)
        return tenant

    @staticmethod
    def may_use(tenant: Tenant | None, model: str) -> bool:
        return tenant is None or tenant.may_use(model)

    def not_found(self, model: str) -> Response:
        return errors.model_not_found_for_tenant(model) if self.enabled else errors.model_not_found(model)

    def admit(self, tenant: Tenant | None) -> Response | None:
        """None when the tenant is within its limits (one request is taken), else the 429."""
        if tenant is None:
            return None
        refusal = self.limiter.admit(tenant)
        if refusal is None:
            return None
        self.metrics.rate_limited.labels(tenant.name, refusal.limit).inc()
        return errors.rate_limited(
            refusal.message, refusal.limit, refusal.retry_after, dict(self.limiter.headers(tenant))
        )

    def headers(self, tenant: Tenant | None) -> dict[str, str]:
        return {} if tenant is None else dict(self.limiter.headers(tenant))

    @staticmethod
    def wants_usage(tenant: Tenant | None, payload: Mapping[str, Any]) -> bool:
        """Whether the router must ask a stream for its usage (the tenant has a token limit, the client
        did not ask itself)."""
        if tenant is None or not tenant.tokens_per_minute or payload.get("stream") is not True:
            return False
        options = payload.get("stream_options")
        return not (isinstance(options, Mapping) and options.get("include_usage") is True)

    @staticmethod
    def with_usage(payload: dict[str, Any]) -> bytes:
        options = payload.get("stream_options")
        payload["stream_options"] = {
            **(options if isinstance(options, Mapping) else {}),
            "include_usage": True,
        }
        return json.dumps(payload).encode("ascii")  # ASCII: a lone surrogate in a string stays escaped

    def charge(self, tenant: Tenant | None, model: str, usage: Usage | None) -> None:
        if tenant is None or usage is None:
            return
        self.limiter.charge(tenant, usage.total)
        self.metrics.tenant_tokens.labels(tenant.name, model, "prompt").inc(usage.prompt_tokens)
        self.metrics.tenant_tokens.labels(tenant.name, model, "completion").inc(usage.completion_tokens)
