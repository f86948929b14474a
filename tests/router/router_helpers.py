"""Helpers of the router suite: fake upstreams, threaded uvicorn servers, KMock objects, metrics.

Everything listens on 127.0.0.1. Upstreams and in-process routers are real uvicorn servers, each on its
own thread and event loop, so requests cross real sockets (streaming, refused connections and
disconnects behave as in production). KMock, child processes and polling come from tests/kmock_harness.py,
shared with the operator suite, which already covers KMock 0.8's gaps (uid/resourceVersion stamping,
declared resources including inferencemodels with their scale subresource, namespaces, the
/api/v1/namespaces path parser).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from kmock_harness import clean_env, vsurge_command  # noqa: F401 - the router tests import them from here
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REPO = Path(__file__).resolve().parents[2]
# tests/ holds kmock_harness (shared with the operator suite), tests/service the tiny checkpoints, operator/
# the operator's kube module that the harness's KMock client uses.
for extra in (REPO / "tests", REPO / "tests" / "service", REPO / "operator"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import kmock_harness  # noqa: E402


def load_benchmark(name: str) -> Any:
    """benchmarks/<name>.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def wait_for(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> Any:
    """kmock_harness.wait_for at this suite's pace (10 s, polled every 20 ms), failing with "waiting for what"."""
    return kmock_harness.wait_for(predicate, timeout, interval, message=f"waiting for {what}")


# ------------------------------------------------------------------------------------------ uvicorn


class ThreadedServer:
    """A uvicorn server on 127.0.0.1 in a daemon thread (own event loop); `stop()` closes it."""

    def __init__(self, app: Any, port: int = 0, *, as_router: bool = False) -> None:
        # A router runs as `vsurge route` runs it: no Server header, and no proxy_headers (the router
        # appends the peer to X-Forwarded-For itself).
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            proxy_headers=not as_router,
            server_header=not as_router,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port = 0

    def start(self, timeout: float = 15.0) -> ThreadedServer:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout, what="uvicorn start")
        if not self.server.started:
            raise RuntimeError("uvicorn did not start (see the log above)")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# ------------------------------------------------------------------------------------- fake upstream


@dataclass
class FakeUpstream:
    """A stand-in for `vsurge serve`: OpenAI-shaped answers that say which upstream gave them.

    Knobs the tests turn: `status` (answer every request with it, e.g. 503 while "draining"), `gate` (a
    stream sends its first event, then waits for the gate before the rest; a non-streamed answer waits
    for it before answering), `load` (the `GET /load` report; None: no such route, 404), `drop` (send
    the response headers, then close the connection without a body byte). It records every request, how
    many are open now, and how many ended because the client (the router) went away.
    """

    name: str
    status: int = 200
    gate: threading.Event | None = None
    load: dict[str, Any] | None = None
    drop: bool = False
    # LoRA (the server's adapter contract): `adapters` lists them in GET /v1/models with `parent` = `base`
    # (None: no such route, as before); `lora_info` is (running, waiting, max_lora) for the
    # `vllm:lora_requests_info` gauge at GET /metrics on this same port (None: no gauge).
    adapters: list[str] | None = None
    base: str = "alpha"
    lora_info: tuple[list[str], list[str], int] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    open: int = 0
    cancelled: int = 0
    server: ThreadedServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    async def _wait_gate(self, request: Request | None = None) -> None:
        while self.gate is not None and not self.gate.is_set():
            # A plain handler is not cancelled when its client leaves; ask, as the vSurge server does.
            if request is not None and await request.is_disconnected():
                raise asyncio.CancelledError
            await asyncio.sleep(0.01)

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        payload = json.loads(body) if body else {}
        self.requests.append(
            {
                "path": request.url.path,
                "headers": dict(request.headers),
                "body": payload,
                "query": request.url.query,
            }
        )
        if self.status != 200:
            return JSONResponse(
                {
                    "error": {
                        "message": f"{self.name} says {self.status}",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                },
                self.status,
                headers={"Retry-After": "1"},
            )
        model = payload.get("model")
        if request.url.path == "/v1/chat/completions" and payload.get("stream"):
            usage = bool((payload.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                self._stream(model, usage), media_type="text/event-stream", headers={"x-upstream": self.name}
            )
        self.open += 1
        try:
            await self._wait_gate(request)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.open -= 1
        if request.url.path == "/v1/chat/completions":
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 1,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": f"hello from {self.name}"},
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                },
                headers={"x-upstream": self.name},
            )
        return JSONResponse(
            {"upstream": self.name, "path": request.url.path, "model": model},
            headers={"x-upstream": self.name},
        )

    async def _stream(self, model: str, include_usage: bool = False) -> AsyncIterator[bytes]:
        # As vsurge serve streams with stream_options.include_usage: `usage: null` on every chunk, then a
        # last chunk with empty choices that carries the usage.
        extra = {"usage": None} if include_usage else {}

        def event(content: str, finish: str | None = None) -> bytes:
            chunk = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": model,
                "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
                **extra,
            }
            return f"data: {json.dumps(chunk)}\n\n".encode()

        self.open += 1
        try:
            yield event(f"first from {self.name}")
            await self._wait_gate()
            yield event(" second", "stop")
            if include_usage:
                last = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
                }
                yield f"data: {json.dumps(last)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise
        finally:
            self.open -= 1

    async def load_route(self, request: Request) -> Response:
        if self.load is None:
            return JSONResponse({"detail": "Not Found"}, 404)
        return JSONResponse(self.load)

    async def models_route(self, request: Request) -> Response:
        if self.adapters is None:
            return JSONResponse({"detail": "Not Found"}, 404)
        data = [{"id": self.base, "object": "model", "owned_by": "vsurge"}]
        data += [
            {"id": a, "object": "model", "parent": self.base, "root": f"/adapters/{a}"} for a in self.adapters
        ]
        return JSONResponse({"object": "list", "data": data})

    async def metrics_route(self, request: Request) -> Response:
        if self.lora_info is None:
            return JSONResponse({"detail": "Not Found"}, 404)
        running, waiting, max_lora = self.lora_info
        text = (
            "# TYPE vllm:lora_requests_info gauge\n"
            f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{",".join(running)}",'
            f'waiting_lora_adapters="{",".join(waiting)}"}} 1.7e9\n'
        )
        return Response(text, media_type="text/plain")

    def app(self) -> Any:
        paths = ["/v1/chat/completions", "/v1/completions", "/v1/count_tokens", "/tokenize", "/detokenize"]
        routes = [Route(p, self.handle, methods=["POST"]) for p in paths]
        polled = [
            Route("/load", self.load_route, methods=["GET"]),
            Route("/v1/models", self.models_route, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ]
        inner = Starlette(routes=[*routes, *polled])

        async def app(scope: Any, receive: Any, send: Any) -> None:
            # The router's polls (GET /load, /v1/models, /metrics) are answered; requests are dropped.
            if scope["type"] == "http" and self.drop and scope["method"] == "POST":
                # Headers out, then the connection goes: the router has not relayed a byte yet.
                self.requests.append({"path": scope["path"], "headers": {}, "body": {}, "query": ""})
                await send({"type": "http.response.start", "status": 200, "headers": []})
                raise RuntimeError("dropped on purpose")
            await inner(scope, receive, send)

        return app


def load_report(
    *,
    waiting: int = 0,
    running: int = 0,
    slots: int = 4,
    kv: float = 0.0,
    status: str = "ready",
    driver: str = "vdriver",
    model: str = "alpha",
) -> dict[str, Any]:
    """A `/load` body as `vsurge serve` writes it (server/load_report.py)."""
    per_model = {
        "driver": driver,
        "requests_waiting": waiting,
        "requests_running": running,
        "slots_used": min(running, slots),
        "slots_total": slots,
        "slots_free": max(0, slots - running),
        "kv_pages_used": None,
        "kv_pages_total": None,
        "kv_usage": kv,
    }
    return {
        "server_load": waiting + running,
        "status": status,
        **{k: v for k, v in per_model.items() if k != "driver"},
        "models": {model: per_model},
    }


# ---------------------------------------------------------------------------------- in-process router


@dataclass
class RunningRouter:
    server: ThreadedServer
    app: Any

    @property
    def url(self) -> str:
        return self.server.url

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0.0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0


def inference_model(
    name: str,
    namespace: str = "models",
    *,
    replicas: int | None = 1,
    served: str | None = None,
    ready: int = 0,
    endpoint: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": "default"},
        "image": "ghcr.io/vsurge-stack/vsurge-service:test",
    }
    if replicas is not None:
        spec["replicas"] = replicas
    if served:
        spec["model"]["servedName"] = served
    obj: dict[str, Any] = {
        "apiVersion": "vsurge.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
    if ready or endpoint:
        obj["status"] = {"readyReplicas": ready, "endpoint": endpoint}
    return obj


# ------------------------------------------------------------------------------------- subprocesses
