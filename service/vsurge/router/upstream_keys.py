"""Each model's own API key, which the router (and its endpoint picker) sends the model's pods.

An InferenceModel with `spec.apiKeySecret: {name, key}` runs pods that refuse any request without
`Authorization: Bearer <that key>` (`VSURGE_API_KEY` from the same Secret, set by the operator), so a pod
reached around the router answers 401. The router reads those Secrets (`get` on the named Secret only: its
RBAC has no list or watch on Secrets) and puts the key on every request it sends the model, in place of
the client's (a tenant's key is the router's business, never the pod's).

A source like the discovery ones: it follows the endpoint table and re-reads each named Secret when the
table changes and every `refresh_seconds` (a rotated key reaches the router within that), in a worker
thread. A Secret that cannot be read is logged once per cause and its model's requests go without a key
(the pods answer 401, which names the problem).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from typing import Any

from .table import EndpointTable, ModelView, SecretRef

log = logging.getLogger(__name__)


class UpstreamKeys:
    def __init__(self, api_client: Any, refresh_seconds: float = 30.0) -> None:
        self.api_client = api_client
        self.refresh_seconds = refresh_seconds
        self._keys: dict[SecretRef, str] = {}
        self._problems: dict[SecretRef, str] = {}
        self._task: asyncio.Task[None] | None = None

    def authorization(self, view: ModelView) -> str | None:
        """`Bearer <key>` for a request to this model's pods, or None (no key asked, or none readable)."""
        for b in view.backends:
            if b.api_key is not None and b.api_key in self._keys:
                return f"Bearer {self._keys[b.api_key]}"
        return None

    async def start(self, table: EndpointTable) -> None:
        self._task = asyncio.create_task(self._follow(table), name="vsurge-router-upstream-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self, table: EndpointTable) -> None:
        while True:
            changed = table.changed_event()
            refs = {b.api_key for v in table.models() for b in v.backends if b.api_key is not None}
            for ref in list(self._keys):
                if ref not in refs:
                    del self._keys[ref]
            for ref in refs:
                await self._read(ref)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=self.refresh_seconds)

    async def _read(self, ref: SecretRef) -> None:
        try:
            value = await asyncio.to_thread(self._get, ref)
        except Exception as e:  # noqa: BLE001 - logged; the pods' 401 says the rest
            problem = f"{type(e).__name__}: {getattr(e, 'status', '')} {getattr(e, 'reason', '')}".strip()
            if self._problems.get(ref) != problem:
                log.warning("API key Secret %s/%s unreadable: %s", ref.namespace, ref.name, problem)
                self._problems[ref] = problem
            return
        self._problems.pop(ref, None)
        if value is None:
            log.warning("API key Secret %s/%s has no key %r", ref.namespace, ref.name, ref.key)
            self._keys.pop(ref, None)
        else:
            self._keys[ref] = value

    def _get(self, ref: SecretRef) -> str | None:
        import kubernetes

        secret = kubernetes.client.CoreV1Api(self.api_client).read_namespaced_secret(
            ref.name, ref.namespace, _request_timeout=10
        )
        raw = (secret.data or {}).get(ref.key)
        return base64.b64decode(raw).decode("utf-8").strip() if raw else None
