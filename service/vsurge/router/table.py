"""The endpoint table: which upstream URLs serve which model, as the discovery sources report it.

Each source (the static file, one Kubernetes watch per namespace) publishes `Backend`s under its own
`group` and replaces them wholesale on a relist, so a source never erases another one's entries. Several
backends may serve one served name (the same `servedName` in two namespaces, or a static entry and an
InferenceModel): their upstreams are pooled as replicas of one model.

Pods: an InferenceModel's backend names its Service (`service`). The EndpointSlice watch publishes the
ready pod addresses of each Service (`replace_slices` / `upsert_slice` / `remove_slice`); once a slice of
a backend's Service is known, its upstreams are that Service's ready pods, and requests go to pods
directly. Until then (or when the router may not list EndpointSlices) the backend's own upstreams stand
in: the Service URL from `status.endpoint`.

Aliases (`set_aliases`) let a source name models that are served by another model's pods, e.g. a LoRA
adapter loaded on a base model's replicas: `lookup(alias)` answers with the base model's backends and
pods under the alias's name, and the request keeps the alias as its `model`.

The table lives on the event loop; threads (the Kubernetes watch) hand it updates through
`loop.call_soon_threadsafe`. Every change sets an `asyncio.Event`, which is what requests held for a
model that is waking up wait on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from .uds import SCHEME, socket_path, socket_upstream


class UpstreamURLError(ValueError):
    """An upstream URL that the router cannot use; the message says why."""


def normalize_upstream(url: str) -> str:
    """`http(s)://host[:port][/prefix]` without a trailing slash or `/v1`: the router appends the route;
    `unix:///path/to.sock` (a server on a Unix socket) as `http+unix://` + the encoded path (router/uds.py).

    A trailing `/v1` is dropped because both forms are common (`--base-url .../v1` for the openai client,
    `http://name.ns.svc:11556` in an InferenceModel's status); the routes include `/v1` themselves.
    """
    text = str(url).strip()
    parts = urlsplit(text)
    if parts.scheme == "unix":  # unix:///run/vsurge.sock: a server on a Unix socket (router/uds.py)
        if not parts.path.startswith("/") or parts.netloc or parts.query or parts.fragment:
            raise UpstreamURLError(f"{url!r}: a socket upstream is unix:///absolute/path/to.sock")
        return socket_upstream(parts.path)
    if parts.scheme == SCHEME and parts.netloc:  # the netloc, not the hostname: that is lowercased
        return socket_upstream(socket_path(parts.netloc))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamURLError(f"{url!r} is not an http(s) URL with a host (e.g. http://10.0.0.7:11556)")
    if parts.query or parts.fragment:
        raise UpstreamURLError(f"{url!r} must not have a query or fragment")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


@dataclass(frozen=True)
class WakeTarget:
    """The InferenceModel whose scale subresource wakes a model at zero replicas."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class ServiceRef:
    """The Kubernetes Service whose EndpointSlices list a backend's pods."""

    namespace: str
    name: str


@dataclass(frozen=True)
class SecretRef:
    """A key of a Secret: the model's own API key, which the router sends its pods (upstream_keys.py)."""

    namespace: str
    name: str
    key: str = "api-key"


@dataclass(frozen=True)
class Backend:
    """One source's view of one served model.

    `upstreams` are the ready upstream base URLs (empty: none ready). `wake` is set for InferenceModels,
    which the router can scale; `desired_replicas` is their `spec.replicas` (None: not set).
    """

    model: str
    upstreams: tuple[str, ...]
    key: str
    group: str
    wake: WakeTarget | None = None
    desired_replicas: int | None = None
    created: int = 0
    service: ServiceRef | None = None
    api_key: SecretRef | None = None


@dataclass(frozen=True)
class ModelView:
    """Everything the table knows about one served name: its backends and their ready upstreams (pods
    where the EndpointSlices are known, else the backends' own URLs). `base` is the model whose pods
    serve an alias (None for a model itself)."""

    name: str
    backends: tuple[Backend, ...]
    upstreams: tuple[str, ...] = ()
    base: str | None = None

    @property
    def created(self) -> int:
        return min((b.created for b in self.backends), default=0)


class EndpointTable:
    """Backends by key, grouped by source; lookups by served model name."""

    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}
        # EndpointSlice group (one per watched namespace, or "*") -> slice key -> (its Service, ready pods)
        self._slices: dict[str, dict[str, tuple[ServiceRef, tuple[str, ...]]]] = {}
        self._slice_scopes: dict[str, str | None] = {}  # group -> its namespace (None: all)
        self._aliases: dict[str, dict[str, str]] = {}  # group -> alias -> base model
        self._expected: set[str] = set()
        self._synced: set[str] = set()
        self._changed = asyncio.Event()
        self.version = 0

    # -- sources

    def expect(self, group: str) -> None:
        """Declare a source: the table is `synced` once every declared source has published once."""
        self._expected.add(group)

    def replace_group(self, group: str, backends: Iterable[Backend]) -> None:
        """Everything `group` publishes now (a full list): entries it no longer lists are dropped."""
        for key in [k for k, b in self._backends.items() if b.group == group]:
            del self._backends[key]
        for b in backends:
            self._backends[b.key] = b
        self._synced.add(group)
        self._notify()

    def upsert(self, backend: Backend) -> None:
        if self._backends.get(backend.key) == backend:
            return
        self._backends[backend.key] = backend
        self._notify()

    def remove(self, key: str) -> None:
        if self._backends.pop(key, None) is not None:
            self._notify()

    @property
    def synced(self) -> bool:
        return self._expected <= self._synced

    # -- EndpointSlices

    def replace_slices(
        self, group: str, namespace: str | None, slices: dict[str, tuple[ServiceRef, tuple[str, ...]]]
    ) -> None:
        """Every EndpointSlice of `namespace` (None: all namespaces) after a list."""
        self._slices[group] = dict(slices)
        self._slice_scopes[group] = namespace
        self._notify()

    def upsert_slice(self, group: str, key: str, service: ServiceRef, upstreams: tuple[str, ...]) -> None:
        slices = self._slices.setdefault(group, {})
        if slices.get(key) == (service, upstreams):
            return
        slices[key] = (service, upstreams)
        self._notify()

    def remove_slice(self, group: str, key: str) -> None:
        if self._slices.get(group, {}).pop(key, None) is not None:
            self._notify()

    def forget_slices(self, group: str) -> None:
        """The group can no longer list slices (e.g. forbidden): its backends fall back to Services."""
        if self._slices.pop(group, None) is not None or self._slice_scopes.pop(group, None) is not None:
            self._notify()

    def pods_of(self, service: ServiceRef) -> tuple[str, ...] | None:
        """The ready pods of `service`, or None when no EndpointSlice of it is known (slices not listed in
        its namespace, not allowed, or a Service without a selector, which gets none): the caller then
        uses the backend's own URL. A Service's slices exist as soon as the Service does, empty or not."""
        pods: dict[str, None] = {}
        found = False
        for group, scope in self._slice_scopes.items():
            if scope is not None and scope != service.namespace:
                continue
            for ref, urls in self._slices.get(group, {}).values():
                if ref == service:
                    found = True
                    pods.update(dict.fromkeys(urls))
        return tuple(pods) if found else None

    # -- aliases

    def set_aliases(self, group: str, aliases: dict[str, str]) -> None:
        """Every alias `group` publishes now (alias -> the model whose pods serve it)."""
        if self._aliases.get(group) != aliases:
            self._aliases[group] = dict(aliases)
            self._notify()

    # -- readers

    def _upstreams(self, backends: tuple[Backend, ...]) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for b in backends:
            pods = self.pods_of(b.service) if b.service is not None else None
            seen.update(dict.fromkeys(b.upstreams if pods is None else pods))
        return tuple(seen)

    def lookup(self, model: str) -> ModelView | None:
        backends = tuple(
            sorted((b for b in self._backends.values() if b.model == model), key=lambda b: b.key)
        )
        if backends:
            return ModelView(model, backends, self._upstreams(backends))
        for aliases in self._aliases.values():
            base = aliases.get(model)
            if base is not None and base != model:
                view = self.lookup(base)
                if view is not None and view.base is None:
                    return ModelView(model, view.backends, view.upstreams, base=base)
        return None

    def models(self) -> list[ModelView]:
        names = sorted({b.model for b in self._backends.values()})
        return [v for v in (self.lookup(n) for n in names) if v is not None]

    def adapters(self) -> list[ModelView]:
        """Every alias that resolves (a LoRA adapter on a known model's pods), by name."""
        names = sorted({a for aliases in self._aliases.values() for a in aliases})
        views = (self.lookup(n) for n in names)
        return [v for v in views if v is not None and v.base is not None]

    def changed_event(self) -> asyncio.Event:
        """An event set at the next change; take it *before* reading the table to miss nothing."""
        return self._changed

    def _notify(self) -> None:
        # Replace-then-set: waiters hold the old event, which is set once; new readers get a fresh one.
        self.version += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()
