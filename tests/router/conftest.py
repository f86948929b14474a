"""Fixtures of the router suite: fake upstreams, an in-process router, KMock as the Kubernetes API.

Everything listens on 127.0.0.1; see router_helpers.py for the pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from router_helpers import FakeUpstream, RunningRouter, ThreadedServer


@pytest.fixture
def upstreams() -> Iterator[Callable[..., FakeUpstream]]:
    """`make(name, **knobs)` starts a FakeUpstream on loopback; all are stopped at the end."""
    started: list[FakeUpstream] = []

    def make(name: str, **knobs: Any) -> FakeUpstream:
        up = FakeUpstream(name, **knobs)
        up.server = ThreadedServer(up.app()).start()
        started.append(up)
        return up

    try:
        yield make
    finally:
        for up in started:
            if up.gate is not None:
                up.gate.set()
            assert up.server is not None
            up.server.stop()


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[Callable[..., RunningRouter]]:
    """`start(models={name: [urls]}, **config)`: build_app from a RouterConfig and serve it on loopback."""
    from vsurge.router.app import build_app
    from vsurge.router.config import RouterConfig

    running: list[RunningRouter] = []

    def start(
        models: dict[str, list[str]] | None = None, *, api_client: Any = None, **config: Any
    ) -> RunningRouter:
        if models is not None:
            path = tmp_path / f"static-{len(running)}.yaml"
            path.write_text(
                yaml.safe_dump({"models": [{"name": n, "upstreams": u} for n, u in models.items()]})
            )
            config.setdefault("static_config", str(path))
            config.setdefault("kubernetes", api_client is not None)
        config.setdefault("host", "127.0.0.1")
        config.setdefault("port", 0)
        app = build_app(RouterConfig(**config), api_client=api_client)
        server = ThreadedServer(app, as_router=True).start()
        r = RunningRouter(server, app)
        running.append(r)
        return r

    try:
        yield start
    finally:
        for r in running:
            r.server.stop()


# --------------------------------------------------------------------------------------------- kmock


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """KMock on loopback with the operator suite's gap fixes, and the namespace `models`."""
    import kmock
    from kmock._internal import parsing
    from kmock_harness import KMockCluster, StampingEmulator, fixed_parse_path

    monkeypatch.setattr(parsing, "parse_path", fixed_parse_path)

    # One more gap: KMock sends a DELETED event with the object's last resourceVersion, which the harness's
    # watch filter (it drops events not newer than the watch's resourceVersion) then swallows for objects
    # older than the watch. A real API server stamps the deletion with a new version: do that here.
    handle = StampingEmulator._handle

    async def stamped_delete(self: Any, request: Any) -> Any:
        if request.resource is not None and request.action == kmock.action.DELETE and request.name:
            async with self._lock:
                try:
                    obj = self._objects[request.resource, request.namespace, request.name]
                except KeyError:
                    obj = None
                if obj is not None and not obj.deleted:
                    obj.patch({"metadata": {"resourceVersion": self._next_version()}})
        return await handle(self, request)

    monkeypatch.setattr(StampingEmulator, "_handle", stamped_delete)
    c = KMockCluster().start()
    try:
        c.add_namespace("models")
        c.add_namespace("other")
        yield c
    finally:
        c.stop()
