"""Discovery from the Kubernetes API: InferenceModels (vsurge.io/v1alpha1), listed then watched.

An InferenceModel becomes one `Backend`, and its LoRA adapters (spec.adapters) aliases of its served name
(table.set_aliases: a request naming an adapter goes to the model's pods): its served name (`spec.model.servedName`, default the object's
name), its Service (named after the object, in its namespace: the EndpointSlice watch in slices.py turns
it into the ready pods), its fallback upstream (`status.endpoint`, the Service URL, used only until the
EndpointSlices of its namespace are known) when `status.readyReplicas` > 0, and a wake target (the
object itself, for its scale subresource). The list + watch threads are watching.ListWatcher's; the
scale patch runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .table import (
    Backend,
    EndpointTable,
    SecretRef,
    ServiceRef,
    UpstreamURLError,
    WakeTarget,
    normalize_upstream,
)
from .watching import ListWatcher, Post

log = logging.getLogger(__name__)

API_GROUP = "vsurge.io"
API_VERSION = "v1alpha1"
PLURAL = "inferencemodels"
MERGE_PATCH = "application/merge-patch+json"


# ---------------------------------------------------------------------------------------------- pure


def group_for(namespace: str | None) -> str:
    """The table group of one watch: a namespace, or `*` for all of them."""
    return f"k8s:{namespace or '*'}"


def backend_key(namespace: str, name: str) -> str:
    return f"k8s/{namespace}/{name}"


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return int(value)
    except ValueError:
        return None


def _epoch(timestamp: Any) -> int:
    if not isinstance(timestamp, str):
        return 0
    try:
        return int(datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0


def backend_from_object(obj: Mapping[str, Any], group: str) -> Backend | None:
    """One InferenceModel -> its Backend; None when it has no name or is being deleted."""
    meta = obj.get("metadata") or {}
    name, namespace = meta.get("name"), meta.get("namespace")
    if not name or not namespace or meta.get("deletionTimestamp"):
        return None
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    served = (spec.get("model") or {}).get("servedName") or name
    ready = _count(status.get("readyReplicas")) or 0
    upstreams: tuple[str, ...] = ()
    endpoint = status.get("endpoint")
    if ready > 0 and endpoint:
        try:
            upstreams = (normalize_upstream(endpoint),)
        except UpstreamURLError as e:
            log.warning("InferenceModel %s/%s: unusable status.endpoint: %s", namespace, name, e)
    # spec.replicas is the source of truth (the scale subresource writes it); without it, what the operator
    # reported it wants. None means "not zero as far as we know": the model is starting, not asleep.
    desired = _count(spec.get("replicas"))
    if desired is None:
        desired = _count(status.get("desiredReplicas"))
    return Backend(
        model=str(served),
        upstreams=upstreams,
        key=backend_key(namespace, name),
        group=group,
        wake=WakeTarget(namespace, name),
        desired_replicas=desired,
        created=_epoch(meta.get("creationTimestamp")),
        # The operator names the model's Service after the InferenceModel (operator manifests.service).
        service=ServiceRef(namespace, name),
        api_key=_api_key(namespace, spec.get("apiKeySecret")),
    )


def _api_key(namespace: str, ref: Any) -> SecretRef | None:
    """spec.apiKeySecret ({name, key}): the Secret whose key the pods require (VSURGE_API_KEY)."""
    if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str) or not ref["name"]:
        return None
    key = ref.get("key")
    return SecretRef(namespace, ref["name"], key if isinstance(key, str) and key else "api-key")


def aliases_from_object(obj: Mapping[str, Any]) -> dict[str, str]:
    """An InferenceModel's LoRA adapters (spec.adapters names) -> its served name; {} when being deleted."""
    meta = obj.get("metadata") or {}
    if not meta.get("name") or meta.get("deletionTimestamp"):
        return {}
    spec = obj.get("spec") or {}
    served = str((spec.get("model") or {}).get("servedName") or meta["name"])
    out = {}
    for a in spec.get("adapters") or ():
        name = a.get("name") if isinstance(a, Mapping) else None
        if isinstance(name, str) and name and name != served:
            out[name] = served
    return out


def merge_aliases(per_object: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """One group's aliases from each object's; an adapter name two models claim goes to the first key."""
    out: dict[str, str] = {}
    for key in sorted(per_object):
        for alias, served in per_object[key].items():
            if alias in out and out[alias] != served:
                log.warning(
                    "adapter %s is in two InferenceModels; routed to %s, not %s", alias, out[alias], served
                )
                continue
            out[alias] = served
    return out


# ---------------------------------------------------------------------------------------------- edges


def load_api_client() -> Any:
    """An ApiClient logged in like kubectl: the pod's service account, else $KUBECONFIG / ~/.kube/config.

    Raises kubernetes.config.ConfigException when neither is there.
    """
    import kubernetes

    from vsurge.version import __version__

    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=configuration)
    client = kubernetes.client.ApiClient(configuration)
    client.user_agent = f"vsurge-router/{__version__}"
    return client


class KubeDiscovery(ListWatcher):
    """List + watch InferenceModels in `namespaces` (empty: all), one daemon thread per watch."""

    what = "InferenceModel"

    def __init__(self, api_client: Any, namespaces: Sequence[str] = (), **kwargs: Any) -> None:
        import kubernetes

        super().__init__(namespaces, **kwargs)
        self.api = kubernetes.client.CustomObjectsApi(api_client)
        # group -> backend key -> that InferenceModel's adapters (each group is one watch thread's)
        self._adapters: dict[str, dict[str, dict[str, str]]] = {}

    def list_call(self, namespace: str | None) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        if namespace is None:
            return self.api.list_cluster_custom_object, (API_GROUP, API_VERSION, PLURAL), {}
        return self.api.list_namespaced_custom_object, (API_GROUP, API_VERSION, namespace, PLURAL), {}

    def on_start(self, namespace: str | None, table: EndpointTable) -> None:
        table.expect(group_for(namespace))

    def on_list(
        self, namespace: str | None, items: list[dict[str, Any]], table: EndpointTable, post: Post
    ) -> None:
        group = group_for(namespace)
        backends = [b for b in (backend_from_object(o, group) for o in items) if b is not None]
        post(table.replace_group, group, backends)
        self._adapters[group] = {}
        for o in items:
            meta = o.get("metadata") or {}
            if meta.get("name") and meta.get("namespace"):
                self._adapters[group][backend_key(meta["namespace"], meta["name"])] = aliases_from_object(o)
        post(table.set_aliases, group, merge_aliases(self._adapters[group]))

    def on_event(
        self, namespace: str | None, kind: str, obj: dict[str, Any], table: EndpointTable, post: Post
    ) -> None:
        group = group_for(namespace)
        meta = obj.get("metadata") or {}
        if meta.get("name") and meta.get("namespace"):
            adapters = self._adapters.setdefault(group, {})
            adapters[backend_key(meta["namespace"], meta["name"])] = (
                aliases_from_object(obj) if kind != "DELETED" else {}
            )
            post(table.set_aliases, group, merge_aliases(adapters))
        if kind in ("ADDED", "MODIFIED"):
            backend = backend_from_object(obj, group)
            if backend is not None:
                post(table.upsert, backend)
                return
        if meta.get("name") and meta.get("namespace"):
            post(table.remove, backend_key(meta["namespace"], meta["name"]))


class KubeScaler:
    """Sets an InferenceModel's replicas through its scale subresource (a JSON merge patch)."""

    def __init__(self, api_client: Any, request_timeout: float = 10.0) -> None:
        import kubernetes

        self.api = kubernetes.client.CustomObjectsApi(api_client)
        self.request_timeout = request_timeout

    async def __call__(self, target: WakeTarget, replicas: int) -> None:
        await asyncio.to_thread(self._patch, target, replicas)

    def _patch(self, target: WakeTarget, replicas: int) -> None:
        self.api.patch_namespaced_custom_object_scale(
            API_GROUP,
            API_VERSION,
            target.namespace,
            PLURAL,
            target.name,
            {"spec": {"replicas": replicas}},
            _content_type=MERGE_PATCH,
            _request_timeout=self.request_timeout,
        )
