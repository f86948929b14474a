"""The router's Starlette app: thin routes over the gate, the table, the waker and the forwarder.

Routes:
- `GET /v1/models`, `GET /v1/models/{id}`: every model the table knows (ready or asleep), OpenAI-shaped
  (with tenants: the caller's models only);
- `POST /v1/chat/completions`, `/v1/completions`, `/v1/count_tokens`, `/tokenize`, `/detokenize`, and
  `/v1/responses`, `/v1/messages[/count_tokens]`, `/v1/embeddings`, `/pooling`, the `/render` routes: by the
  body's `model`, to the pod the routing policy picks (waking the model first if it has none);
- `GET /liveness` (always 200), `GET /readiness` (200 once every discovery source has reported once);
- `GET /metrics`: the router's Prometheus metrics.

A proxied request: the gate authenticates it (tenants), the body is read (bounded) and parsed for `model`,
the tenant's access and limits are checked, a span starts, the model's pods are found (or woken), the
prompt's prefix hashes are computed when the model is routed by prefix, and the forwarder sends it.

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

from . import errors, uds
from .admission import Gate
from .config import RouterConfig
from .metrics import RouterMetrics
from .prefix import request_hashes
from .proxy import Forwarder, NoUpstreamAvailable, ProxiedResponse, request_headers
from .ratelimit import RateLimiter
from .table import EndpointTable, ModelView
from .tenants import Tenant
from .tracing import RouterTracing
from .upstream_keys import UpstreamKeys
from .usage import UsageScanner
from .wake import UnknownModel, WakeError, Waker

log = logging.getLogger(__name__)

T = TypeVar("T")

_GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/count_tokens", "/tokenize", "/detokenize")
# the other APIs over the same engine, and the gateway's renders; all carry `model` in the body. A stored
# response's GET/DELETE/cancel has no body: it is asked of the pod that holds it (docs/api.md).
_APIS = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings", "/pooling")
PROXIED_PATHS = _GENERATION + _APIS + ("/v1/chat/completions/render", "/v1/completions/render")
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
    card: dict[str, Any] = {
        "id": view.name,
        "object": "model",
        "created": view.created,
        "owned_by": "vsurge",
        "ready": bool(view.upstreams),
    }
    if view.base is not None:  # a LoRA adapter, as `vsurge serve` lists it: `parent` is the base model
        card["parent"] = view.base
    return card


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
        gate: Gate | None = None,
        tracing: RouterTracing | None = None,
        prefix_block_bytes: int = 256,
        prefix_max_blocks: int = 512,
        upstream_keys: UpstreamKeys | None = None,
    ) -> None:
        self.table = table
        self.waker = waker
        self.forwarder = forwarder
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.retry_after_seconds = retry_after_seconds
        self.gate = gate if gate is not None else Gate(None, RateLimiter(), metrics)
        self.tracing = tracing if tracing is not None else RouterTracing()
        self.prefix_block_bytes = prefix_block_bytes
        self.prefix_max_blocks = prefix_max_blocks
        self.upstream_keys = upstream_keys

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
        tenant = self.gate.authenticate(request.headers)
        if isinstance(tenant, Response):
            return tenant
        views = [*self.table.models(), *self.table.adapters()]
        cards = [model_card(v) for v in views if self.gate.may_use(tenant, v.name)]
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request.headers)
        if isinstance(tenant, Response):
            return tenant
        name = request.path_params["model"]
        view = self.table.lookup(name)
        if view is None or not self.gate.may_use(tenant, name):
            return self.gate.not_found(name)
        return JSONResponse(model_card(view))

    # -- proxied routes

    async def proxy(self, request: Request) -> Response:
        started = time.perf_counter()
        tenant = self.gate.authenticate(request.headers)
        if isinstance(tenant, Response):  # 401 before the body is read
            return self._done("", tenant)
        parsed = await self._read_request(request)
        if isinstance(parsed, Response):
            return self._done("", parsed, tenant)
        payload, body = parsed
        model = payload["model"]
        view = self.table.lookup(model)
        if view is None or not self.gate.may_use(tenant, model):
            return self._done("", self.gate.not_found(model), tenant)
        base = view.base
        refused = self.gate.admit(tenant)
        if refused is not None:
            return self._done(model, refused, tenant)
        strip_usage = self.gate.wants_usage(tenant, payload)
        if strip_usage:
            body = self.gate.with_usage(payload)
        scanner = None
        if tenant is not None or self.tracing.enabled:
            scanner = UsageScanner(stream=payload.get("stream") is True, strip_usage_frame=strip_usage)
        span = self.tracing.start(request.url.path, model, request.headers, payload)
        self.tracing.set_tenant(span, tenant.name if tenant is not None else None)

        in_flight = self.metrics.in_flight.labels(model)
        in_flight.inc()

        def finish(status: int, response: ProxiedResponse | None = None, error: str | None = None) -> None:
            in_flight.dec()
            self.metrics.requests.labels(model, str(status)).inc()
            self.metrics.request_duration.labels(model).observe(time.perf_counter() - started)
            usage = scanner.usage if scanner is not None else None
            if tenant is not None:
                self.metrics.tenant_requests.labels(tenant.name, model, str(status)).inc()
                self.gate.charge(tenant, model, usage)
            attempts = response.attempts if response is not None else []
            decision = response.decision if response is not None else None
            self.tracing.finish(
                span,
                status,
                upstream=response.upstream_url if response is not None else None,
                policy=decision.policy if decision is not None else None,
                pick=decision.how if decision is not None else None,
                attempts=[(a.upstream, a.outcome) for a in attempts],
                usage=(usage.prompt_tokens, usage.completion_tokens) if usage is not None else None,
                error=error,
            )

        try:
            upstreams = await until_disconnect(request, self.waker.upstreams_for(model))
            headers = request_headers(
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                request.client.host if request.client else None,
            )
            own_key = self.upstream_keys.authorization(view) if self.upstream_keys is not None else None
            if self.gate.enabled or own_key:  # the tenant's key is the router's business, not the pod's
                headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
            if own_key:  # the model's pods take only their own key (spec.apiKeySecret)
                headers.append(("authorization", own_key))
            headers = self.tracing.outgoing_headers(span, headers)
            hashes = self._hashes(request.url.path, payload, model, upstreams, base)
            response = await until_disconnect(
                request,
                self.forwarder.forward(
                    model,
                    upstreams,
                    request.method,
                    request.url.path,
                    request.url.query,
                    headers,
                    body,
                    hashes=hashes,
                    scanner=scanner,
                    base=base,
                ),
            )
        except ClientGone:
            finish(CLIENT_CLOSED, error="client_closed")
            return Response(status_code=CLIENT_CLOSED)
        except UnknownModel:  # deleted while the request was held
            finish(404, error="model_not_found")
            return self.gate.not_found(model)
        except WakeError as e:
            finish(503, error=e.code)
            return errors.unavailable(str(e), e.code, self.retry_after_seconds)
        except NoUpstreamAvailable as e:
            finish(503, error="upstream_unavailable")
            log.warning("model %s: no upstream could be reached (%s)", model, e)
            return errors.unavailable(
                f"No replica of the model `{model}` could be reached; try again later.",
                "upstream_unavailable",
                self.retry_after_seconds,
            )
        except BaseException:
            finish(500, error="internal_error")
            raise
        for k, v in self.gate.headers(tenant).items():
            response.raw_headers.append((k.encode("latin-1"), v.encode("latin-1")))
        status = response.status_code
        response.add_close_callback(lambda: finish(status, response))
        return response

    async def _read_request(self, request: Request) -> tuple[dict[str, Any], bytes] | Response:
        """The body (bounded) and its JSON object with a `model`, or the 4xx to answer."""
        try:
            body = await read_body(request, self.max_body_bytes)
        except BodyTooLarge:
            return errors.error_response(
                413,
                f"The request body is larger than {self.max_body_bytes} bytes.",
                code="request_too_large",
            )
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            return errors.bad_request(f"We could not parse the JSON body of your request: {e}")
        if not isinstance(payload, dict):
            return errors.bad_request("The request body must be a JSON object.")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return errors.bad_request("You must provide a model parameter.", param="model")
        return payload, body

    def _hashes(
        self, path: str, payload: dict[str, Any], model: str, upstreams: tuple[str, ...], base: str | None
    ) -> list[bytes]:
        if self.forwarder.picker.policy_for(base or model, upstreams) != "prefix":
            return []
        return request_hashes(path, payload, model, self.prefix_block_bytes, self.prefix_max_blocks)

    def _done(self, model: str, response: Response, tenant: Tenant | None = None) -> Response:
        self.metrics.requests.labels(model, str(response.status_code)).inc()
        if tenant is not None:
            self.metrics.tenant_requests.labels(tenant.name, model, str(response.status_code)).inc()
        return response


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    if status == 405:
        return errors.error_response(405, f"Method {request.method} is not allowed on {request.url.path}.")
    return errors.error_response(404, f"Unknown route {request.url.path}.", code="not_found")


def create_app(
    router: Router,
    sources: Sequence[Source] = (),
    client: httpx.AsyncClient | None = None,
    *,
    clients: Sequence[httpx.AsyncClient] = (),
) -> Starlette:
    """The Starlette app; `sources` start with it and stop with it, `client`/`clients` are closed at the
    end, and the tracer provider is flushed."""

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
            for c in [*([client] if client is not None else []), *clients]:
                await c.aclose()
            router.tracing.shutdown()

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


def build_app(cfg: RouterConfig, *, api_client: Any = None, tracer_provider: Any = None) -> Starlette:
    """Everything `vsurge route` runs, from its settings; `api_client` replaces the Kubernetes login,
    `tracer_provider` the OTEL_* environment."""
    from .kube import KubeDiscovery, KubeScaler, load_api_client
    from .load_picking import LoadTracker
    from .loadpoll import LoadBook, LoadPoller
    from .lora import AdapterBook, AdapterPoller
    from .policies import ForgetGonePods, Picker
    from .slices import EndpointSliceDiscovery
    from .static import StaticDiscovery
    from .tenants import ApiKeys

    table = EndpointTable()
    metrics = RouterMetrics(table)
    sources: list[Source] = []
    scaler = None
    keys = ApiKeys(cfg.api_keys_file, cfg.api_keys_reload_seconds) if cfg.api_keys_file else None
    if keys is not None:
        sources.append(keys)
    else:
        log.warning(
            "no --api-keys-file: the router is open; anyone who reaches it can use and wake every model"
        )
    if cfg.static_config:
        sources.append(StaticDiscovery(cfg.static_config, cfg.static_reload_seconds))
    if cfg.use_kubernetes:
        api_client = api_client if api_client is not None else load_api_client()
        watch = {
            "watch_timeout_seconds": cfg.watch_timeout_seconds,
            "connect_timeout": cfg.connect_timeout_seconds,
        }
        sources.append(KubeDiscovery(api_client, cfg.namespaces, **watch))
        if cfg.endpoint_slices:
            sources.append(EndpointSliceDiscovery(api_client, cfg.namespaces, **watch))
        scaler = KubeScaler(api_client)
    # No read timeout: a non-streamed generation may take minutes; the client's own timeout applies, and
    # its disconnect cancels the upstream request. trust_env=False: proxy variables must not reroute
    # in-cluster traffic.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=cfg.connect_timeout_seconds),
        **uds.pool(),  # its limits, on TCP and on upstreams' Unix sockets (unix:///path) alike
        trust_env=False,
        follow_redirects=False,
    )
    clients: list[httpx.AsyncClient] = []
    tracker = LoadTracker(cfg.eject_seconds)
    book = LoadBook(stale_after=max(1.0, 5 * cfg.load_poll_seconds))
    adapter_book = AdapterBook(stale_after=max(2.0, 5 * cfg.lora_poll_seconds))
    if cfg.load_poll_seconds > 0 or cfg.lora_poll_seconds > 0:
        # the pods' own reports (/load, /v1/models, the LoRA gauge): short timeouts, one pool for both
        poll_client = httpx.AsyncClient(
            timeout=httpx.Timeout(1.0, connect=min(1.0, cfg.connect_timeout_seconds)),
            **uds.pool(),
            trust_env=False,
        )
        clients.append(poll_client)
        if cfg.load_poll_seconds > 0:
            sources.append(LoadPoller(poll_client, book, tracker, metrics, interval=cfg.load_poll_seconds))
        if cfg.lora_poll_seconds > 0:
            sources.append(AdapterPoller(poll_client, adapter_book, interval=cfg.lora_poll_seconds))
    picker = Picker(
        tracker,
        book,
        routing=cfg.routing,
        eps=cfg.prefix_epsilon,
        key_blocks=cfg.prefix_key_blocks,
        index_capacity=cfg.prefix_index_size,
        adapters=adapter_book,
    )
    sources.append(ForgetGonePods(picker))
    keys_of_models = UpstreamKeys(api_client) if cfg.use_kubernetes else None
    if keys_of_models is not None:
        sources.append(keys_of_models)
    forwarder = Forwarder(client, picker, metrics, cfg.max_attempts)
    waker = Waker(table, scaler, cfg.wake_timeout_seconds, metrics)
    tracing = RouterTracing(tracer_provider) if tracer_provider is not None else RouterTracing.from_env()
    router = Router(
        table,
        waker,
        forwarder,
        metrics,
        max_body_bytes=cfg.max_body_bytes,
        retry_after_seconds=cfg.retry_after_seconds,
        gate=Gate(keys, RateLimiter(replicas=cfg.tenant_limit_replicas), metrics),
        tracing=tracing,
        prefix_block_bytes=cfg.prefix_block_bytes,
        upstream_keys=keys_of_models,
    )
    if cfg.ext_proc_port:  # the Gateway API Inference Extension's endpoint picker (extproc.py)
        from .extproc import EndpointPicker, ExtProcServer

        epp = EndpointPicker(
            table,
            picker,
            router.gate,
            metrics,
            keys_of_models,
            waker,
            fallbacks=cfg.ext_proc_fallbacks,
            max_body_bytes=cfg.max_body_bytes,
            prefix_block_bytes=cfg.prefix_block_bytes,
            retry_after_seconds=cfg.retry_after_seconds,
        )
        sources.append(ExtProcServer(epp, cfg.host, cfg.ext_proc_port))
    return create_app(router, sources, client, clients=clients)
