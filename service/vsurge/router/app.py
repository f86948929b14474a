"""The router's Starlette app: thin routes over the table, the waker and the forwarder.

Routes:
- `GET /v1/models`, `GET /v1/models/{id}`: every model the table knows (ready or asleep), OpenAI-shaped;
- `POST /v1/chat/completions`, `/v1/completions`, `/v1/count_tokens`, `/tokenize`, `/detokenize`: by the
  body's `model`, to the least-loaded ready upstream (waking the model first if it has none);
- `GET /liveness` (always 200), `GET /readiness` (200 once every discovery source has reported once);
- `GET /metrics`: the router's Prometheus metrics.

A client that disconnects while its request is held (wake-up) or waits for a non-streamed answer cancels
the upstream request too, so the vSurge server frees the slot; streams are cancelled by the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Protocol, TypeVar

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from . import errors
from .config import RouterConfig
from .metrics import RouterMetrics
from .picking import LoadTracker
from .proxy import Forwarder, NoUpstreamAvailable, ProxiedResponse, request_headers
from .table import EndpointTable, ModelView
from .wake import UnknownModel, WakeError, Waker

log = logging.getLogger(__name__)

T = TypeVar("T")

PROXIED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/count_tokens", "/tokenize", "/detokenize")
CLIENT_CLOSED = 499  # nginx's status for "the client went away"; only ever seen in metrics


class Source(Protocol):
    async def start(self, table: EndpointTable) -> None: ...

    async def stop(self) -> None: ...


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` unless the client disconnects first (then cancel it and raise ClientGone).

    Only valid once the body has been read: then the next ASGI message can only be the disconnect.
    """
    task = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        gone.cancel()
        raise
    if task in done:
        gone.cancel()
        return task.result()
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, Exception):
        pass
    else:
        # It finished just as the client left: an open upstream response must still be closed.
        if isinstance(result, ProxiedResponse):
            await result.discard()
    raise ClientGone


def model_card(view: ModelView) -> dict[str, Any]:
    return {
        "id": view.name,
        "object": "model",
        "created": view.created,
        "owned_by": "vsurge",
        "ready": bool(view.upstreams),
    }


class Router:
    """The request handlers and the state they share."""

    def __init__(
        self,
        table: EndpointTable,
        waker: Waker,
        forwarder: Forwarder,
        metrics: RouterMetrics,
        *,
        max_body_bytes: int = 8 * 1024 * 1024,
        retry_after_seconds: float = 5.0,
    ) -> None:
        self.table = table
        self.waker = waker
        self.forwarder = forwarder
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.retry_after_seconds = retry_after_seconds

    # -- probes and metrics

    async def liveness(self, request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def readiness(self, request: Request) -> Response:
        if not self.table.synced:
            return JSONResponse({"status": "starting", "reason": "discovery has not reported yet"}, 503)
        return JSONResponse({"status": "ready", "models": len(self.table.models())})

    async def prometheus(self, request: Request) -> Response:
        payload, content_type = self.metrics.render()
        return Response(payload, media_type=content_type)

    # -- models

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(v) for v in self.table.models()]})

    async def get_model(self, request: Request) -> Response:
        view = self.table.lookup(request.path_params["model"])
        if view is None:
            return errors.model_not_found(request.path_params["model"])
        return JSONResponse(model_card(view))

    # -- proxied routes

    async def proxy(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await read_body(request, self.max_body_bytes)
        except BodyTooLarge:
            return self._done(
                "",
                errors.error_response(
                    413,
                    f"The request body is larger than {self.max_body_bytes} bytes.",
                    code="request_too_large",
                ),
            )
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            return self._done(
                "", errors.bad_request(f"We could not parse the JSON body of your request: {e}")
            )
        if not isinstance(payload, dict):
            return self._done("", errors.bad_request("The request body must be a JSON object."))
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return self._done("", errors.bad_request("You must provide a model parameter.", param="model"))
        if self.table.lookup(model) is None:
            return self._done("", errors.model_not_found(model))

        in_flight = self.metrics.in_flight.labels(model)
        in_flight.inc()

        def finish(status: int) -> None:
            in_flight.dec()
            self.metrics.requests.labels(model, str(status)).inc()
            self.metrics.request_duration.labels(model).observe(time.perf_counter() - started)

        try:
            upstreams = await until_disconnect(request, self.waker.upstreams_for(model))
            headers = request_headers(
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                request.client.host if request.client else None,
            )
            response = await until_disconnect(
                request,
                self.forwarder.forward(
                    model, upstreams, request.method, request.url.path, request.url.query, headers, body
                ),
            )
        except ClientGone:
            finish(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        except UnknownModel:  # deleted while the request was held
            finish(404)
            return errors.model_not_found(model)
        except WakeError as e:
            finish(503)
            return errors.unavailable(str(e), e.code, self.retry_after_seconds)
        except NoUpstreamAvailable as e:
            finish(503)
            log.warning("model %s: no upstream could be reached (%s)", model, e)
            return errors.unavailable(
                f"No replica of the model `{model}` could be reached; try again later.",
                "upstream_unavailable",
                self.retry_after_seconds,
            )
        except BaseException:
            finish(500)
            raise
        status = response.status_code
        response.add_close_callback(lambda: finish(status))
        return response

    def _done(self, model: str, response: Response) -> Response:
        self.metrics.requests.labels(model, str(response.status_code)).inc()
        return response


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    if status == 405:
        return errors.error_response(405, f"Method {request.method} is not allowed on {request.url.path}.")
    return errors.error_response(404, f"Unknown route {request.url.path}.", code="not_found")


def create_app(
    router: Router, sources: Sequence[Source] = (), client: httpx.AsyncClient | None = None
) -> Starlette:
    """The Starlette app; `sources` start with it and stop with it, `client` is closed at the end."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started: list[Source] = []
        try:
            for source in sources:
                await source.start(router.table)
                started.append(source)
            yield
        finally:
            for source in reversed(started):
                await source.stop()
            if client is not None:
                await client.aclose()

    routes = [
        Route("/liveness", router.liveness, methods=["GET"]),
        Route("/readiness", router.readiness, methods=["GET"]),
        Route("/metrics", router.prometheus, methods=["GET"]),
        Route("/v1/models", router.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", router.get_model, methods=["GET"]),
        *(Route(path, router.proxy, methods=["POST"]) for path in PROXIED_PATHS),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_found})
    app.state.router = router
    return app


def build_app(cfg: RouterConfig, *, api_client: Any = None) -> Starlette:
    """Everything `vsurge route` runs, from its settings; `api_client` replaces the Kubernetes login."""
    from .kube import KubeDiscovery, KubeScaler, load_api_client
    from .static import StaticDiscovery

    table = EndpointTable()
    metrics = RouterMetrics(table)
    sources: list[Source] = []
    scaler = None
    if cfg.static_config:
        sources.append(StaticDiscovery(cfg.static_config, cfg.static_reload_seconds))
    if cfg.use_kubernetes:
        api_client = api_client if api_client is not None else load_api_client()
        sources.append(
            KubeDiscovery(
                api_client,
                cfg.namespaces,
                watch_timeout_seconds=cfg.watch_timeout_seconds,
                connect_timeout=cfg.connect_timeout_seconds,
            )
        )
        scaler = KubeScaler(api_client)
    # No read timeout: a non-streamed generation may take minutes; the client's own timeout applies, and
    # its disconnect cancels the upstream request. trust_env=False: proxy variables must not reroute
    # in-cluster traffic.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=cfg.connect_timeout_seconds),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=30),
        trust_env=False,
        follow_redirects=False,
    )
    forwarder = Forwarder(client, LoadTracker(cfg.eject_seconds), metrics, cfg.max_attempts)
    waker = Waker(table, scaler, cfg.wake_timeout_seconds, metrics)
    router = Router(
        table,
        waker,
        forwarder,
        metrics,
        max_body_bytes=cfg.max_body_bytes,
        retry_after_seconds=cfg.retry_after_seconds,
    )
    return create_app(router, sources, client)
