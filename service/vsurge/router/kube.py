"""Discovery from the Kubernetes API: InferenceModels (vsurge.io/v1alpha1), listed then watched.

An InferenceModel becomes one `Backend`: its served name (`spec.model.servedName`, default the object's
name), its upstream (`status.endpoint`, the model's Service, written by the operator) when
`status.readyReplicas` > 0, and a wake target (the object itself, for its scale subresource). The router
sees the Service, not the pods: kube-proxy spreads connections over the ready pods, and the router's RBAC
stays at list/watch on inferencemodels and get/patch on inferencemodels/scale.

The official client is synchronous, so each watched namespace (or the whole cluster) gets a daemon thread
running list -> watch from that resourceVersion -> relist when the watch ends (the server closes it every
`watch_timeout_seconds`, or it fails, e.g. 410 Gone). A full relist each cycle costs one small request
and repairs anything a broken watch missed. Updates reach the table on the event loop through
`call_soon_threadsafe`. The scale patch runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .table import Backend, EndpointTable, UpstreamURLError, WakeTarget, normalize_upstream

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
    )


# ---------------------------------------------------------------------------------------------- edges


def load_api_client() -> Any:
    """An ApiClient logged in like kubectl: the pod's service account, else $KUBECONFIG / ~/.kube/config.

    Raises kubernetes.config.ConfigException when neither is there.
    """
    import kubernetes

    from vsurge import __version__

    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=configuration)
    client = kubernetes.client.ApiClient(configuration)
    client.user_agent = f"vsurge-router/{__version__}"
    return client


class KubeDiscovery:
    """List + watch InferenceModels in `namespaces` (empty: all), one daemon thread per watch."""

    def __init__(
        self,
        api_client: Any,
        namespaces: Sequence[str] = (),
        *,
        watch_timeout_seconds: int = 300,
        connect_timeout: float = 10.0,
        max_backoff: float = 30.0,
    ) -> None:
        import kubernetes

        self.api = kubernetes.client.CustomObjectsApi(api_client)
        self.namespaces: list[str | None] = list(dict.fromkeys(namespaces)) or [None]
        self.watch_timeout_seconds = watch_timeout_seconds
        self.connect_timeout = connect_timeout
        self.max_backoff = max_backoff
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []

    async def start(self, table: EndpointTable) -> None:
        loop = asyncio.get_running_loop()

        def post(fn: Callable[..., None], *args: Any) -> None:
            loop.call_soon_threadsafe(fn, *args)

        for ns in self.namespaces:
            table.expect(group_for(ns))
            t = threading.Thread(
                target=self._run,
                args=(ns, table, post),
                name=f"vsurge-router-watch-{ns or 'all'}",
                daemon=True,
            )
            self._threads.append(t)
            t.start()

    async def stop(self) -> None:
        # The threads may sit in a blocking read; they are daemons and stop at their next event or timeout.
        self._stop.set()
        for w in list(self._watches):
            w.stop()

    # -- the loop of one thread

    def _list_call(self, namespace: str | None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if namespace is None:
            return self.api.list_cluster_custom_object, (API_GROUP, API_VERSION, PLURAL)
        return self.api.list_namespaced_custom_object, (API_GROUP, API_VERSION, namespace, PLURAL)

    def _run(self, namespace: str | None, table: EndpointTable, post: Callable[..., None]) -> None:
        group = group_for(namespace)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                fn, args = self._list_call(namespace)
                listing = fn(*args, _request_timeout=(self.connect_timeout, 30))
                items = listing.get("items") or []
                backends = [b for b in (backend_from_object(o, group) for o in items) if b is not None]
                post(table.replace_group, group, backends)
                rv = (listing.get("metadata") or {}).get("resourceVersion")
                backoff = 0.5
                self._watch(namespace, group, rv, table, post)
            except Exception as e:  # any failure: log, back off, relist; discovery must not die
                if self._stop.is_set():
                    break
                log.warning("InferenceModel watch (%s) failed: %s; relisting in %.1fs", group, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff)
            except BaseException:  # interpreter shutdown
                break

    def _watch(
        self,
        namespace: str | None,
        group: str,
        rv: str | None,
        table: EndpointTable,
        post: Callable[..., None],
    ) -> None:
        import kubernetes

        fn, args = self._list_call(namespace)
        w = kubernetes.watch.Watch()
        self._watches.append(w)
        kwargs: dict[str, Any] = {
            "timeout_seconds": self.watch_timeout_seconds,
            "allow_watch_bookmarks": True,
            # Read timeout past the server-side timeout: a silent, half-open connection ends too.
            "_request_timeout": (self.connect_timeout, self.watch_timeout_seconds + 30),
        }
        if rv:
            kwargs["resource_version"] = rv
        try:
            for event in w.stream(fn, *args, **kwargs):
                if self._stop.is_set():
                    break
                if not isinstance(event, dict):
                    continue
                obj = event.get("raw_object") or event.get("object") or {}
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED"):
                    backend = backend_from_object(obj, group)
                    if backend is not None:
                        post(table.upsert, backend)
                        continue
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    meta = obj.get("metadata") or {}
                    if meta.get("name") and meta.get("namespace"):
                        post(table.remove, backend_key(meta["namespace"], meta["name"]))
        finally:
            w.stop()
            self._watches.remove(w)


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
