"""The pods behind each model's Service, from its EndpointSlices (discovery.k8s.io), listed then watched.

The EndpointSlice controller lists a Service's pods in slices labelled `kubernetes.io/service-name` and
copies the Service's own labels onto them, so the operator's `vsurge.io/model` label selects exactly the
slices of model Services. A pod counts when its endpoint is ready (`conditions.ready` true, or unset,
which the API says to read as ready) and not terminating: a pod whose preStop hook announced the stop
turns unready first, so it leaves the list before its server starts refusing. The pod's URL is its first
address and the slice's `http` port (the name the operator gives the model port).

`discovery.k8s.io/v1` (Kubernetes 1.21+) is listed; a server without it (1.20) gets `v1beta1`, whose
endpoints have the same fields. The router's RBAC needs list + watch on `endpointslices` and nothing
more. If that is refused (an older chart), the router logs it, keeps going to Services (the backends'
`status.endpoint`) and asks again every minute.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .table import EndpointTable, ServiceRef
from .watching import ListWatcher, Post

log = logging.getLogger(__name__)

GROUP = "discovery.k8s.io"
VERSIONS = ("v1", "v1beta1")
PLURAL = "endpointslices"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MODEL_LABEL = "vsurge.io/model"
SELECTOR = f"{MODEL_LABEL},{SERVICE_NAME_LABEL}"
PORT_NAME = "http"
FORBIDDEN_RETRY_SECONDS = 60.0


def slice_group(namespace: str | None) -> str:
    return f"slices:{namespace or '*'}"


def slice_key(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata") or {}
    if not meta.get("name") or not meta.get("namespace"):
        return None
    return f"{meta['namespace']}/{meta['name']}"


def _host(address: str, address_type: str) -> str | None:
    if address_type == "FQDN":
        return address or None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _serving(endpoint: Mapping[str, Any]) -> bool:
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def slice_pods(
    obj: Mapping[str, Any], port_name: str = PORT_NAME
) -> tuple[ServiceRef, tuple[str, ...]] | None:
    """One EndpointSlice -> (its Service, the URLs of its ready pods); None when it names no Service."""
    meta = obj.get("metadata") or {}
    service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    namespace = meta.get("namespace")
    if not service or not namespace or meta.get("deletionTimestamp"):
        return None
    ref = ServiceRef(namespace, service)
    port = next(
        (
            p.get("port")
            for p in obj.get("ports") or ()
            if isinstance(p, Mapping) and p.get("name") == port_name
        ),
        None,
    )
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return ref, ()
    address_type = obj.get("addressType") or "IPv4"
    urls: dict[str, None] = {}
    for endpoint in obj.get("endpoints") or ():
        if not isinstance(endpoint, Mapping) or not _serving(endpoint):
            continue
        addresses = [a for a in endpoint.get("addresses") or () if isinstance(a, str)]
        host = _host(addresses[0], address_type) if addresses else None
        if host:
            urls[f"http://{host}:{port}"] = None
    return ref, tuple(urls)


class EndpointSliceDiscovery(ListWatcher):
    """List + watch the EndpointSlices of model Services in `namespaces` (empty: all)."""

    what = "EndpointSlice"

    def __init__(self, api_client: Any, namespaces: Sequence[str] = (), **kwargs: Any) -> None:
        import kubernetes

        super().__init__(namespaces, **kwargs)
        self.api = kubernetes.client.CustomObjectsApi(api_client)
        self.version: dict[str | None, str] = {}  # namespace -> the API version that answered

    def list_call(self, namespace: str | None) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        version = self.version.get(namespace, VERSIONS[0])
        kwargs = {"label_selector": SELECTOR}
        if namespace is None:
            return self.api.list_cluster_custom_object, (GROUP, version, PLURAL), kwargs
        return self.api.list_namespaced_custom_object, (GROUP, version, namespace, PLURAL), kwargs

    def on_list(
        self, namespace: str | None, items: list[dict[str, Any]], table: EndpointTable, post: Post
    ) -> None:
        slices = {}
        for obj in items:
            key, parsed = slice_key(obj), slice_pods(obj)
            if key is not None and parsed is not None:
                slices[key] = parsed
        post(table.replace_slices, slice_group(namespace), namespace, slices)

    def on_event(
        self, namespace: str | None, kind: str, obj: dict[str, Any], table: EndpointTable, post: Post
    ) -> None:
        key = slice_key(obj)
        if key is None:
            return
        parsed = slice_pods(obj) if kind != "DELETED" else None
        if parsed is None:
            post(table.remove_slice, slice_group(namespace), key)
        else:
            post(table.upsert_slice, slice_group(namespace), key, parsed[0], parsed[1])

    def on_failure(
        self, namespace: str | None, error: Exception, table: EndpointTable, post: Post
    ) -> float | None:
        status = getattr(error, "status", None)
        version = self.version.get(namespace, VERSIONS[0])
        if status == 404 and version != VERSIONS[-1]:
            self.version[namespace] = VERSIONS[VERSIONS.index(version) + 1]
            log.info("EndpointSlices: %s/%s not served; using %s", GROUP, version, self.version[namespace])
            return 0.0
        if status == 404:  # no EndpointSlice API at all: Services it is; look again now and then
            self.version.pop(namespace, None)
            log.warning(
                "EndpointSlices are not served by this API server; routing to the models' Services; "
                "asking again in %.0fs",
                FORBIDDEN_RETRY_SECONDS,
            )
            post(table.forget_slices, slice_group(namespace))
            return FORBIDDEN_RETRY_SECONDS
        if status in (401, 403):
            log.error(
                "EndpointSlices in %s: the API answered %s; routing to the models' Services instead of "
                "their pods (grant list/watch on discovery.k8s.io endpointslices); asking again in %.0fs",
                namespace or "all namespaces",
                status,
                FORBIDDEN_RETRY_SECONDS,
            )
            post(table.forget_slices, slice_group(namespace))
            return FORBIDDEN_RETRY_SECONDS
        return None
