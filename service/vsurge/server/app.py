"""vSurgeApiServer: the OpenAI-compatible Starlette app in front of one or several vSurge engines.

Routes are thin: parse (parsing.py) -> run on vSurge -> shape (shaping.py). The server owns the state the
probes report (starting -> ready -> draining, lifecycle.py), the in-flight count that drain waits for, the
metrics registry and the tracer; generation.py and info_routes.py hold the routes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import threading
from collections.abc import Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import errors
from .chat_runs import ChatRuns
from .embeddings import EmbeddingRoutes
from .errors import APIError
from .generation import GenerationRoutes
from .info_routes import InfoRoutes
from .lifecycle import DRAINING, READY, STARTING, STOPPED, Lifecycle
from .lora_routes import LoraRoutes, find_adapter
from .messages_routes import MessagesRoutes
from .metrics import ServerMetrics
from .parsing import read_json
from .profile_routes import ProfileRoutes
from .render_routes import RenderRoutes
from .responses_routes import ResponsesRoutes
from .responses_store import ResponseStore
from .served_model import ServedModel, _error_response
from .token_routes import TokenRoutes
from .tracing import Tracing

log = logging.getLogger(__name__)

# Large enough for a 128k-token prompt as JSON, small enough that a hostile body cannot exhaust memory.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Bodies up to this size are read to the end before a 413, so the client sees the answer rather than a
# connection reset while it is still uploading.
_DRAIN_CAP_BYTES = 64 * 1024 * 1024
# Prompts above this many characters are chat-templated off the event loop, so one huge request does not
# stall every stream.
_OFFLOAD_CHARS = 65536


class vSurgeApiServer(  # noqa: N801 - the seed's name
    Lifecycle,
    GenerationRoutes,
    ChatRuns,
    ResponsesRoutes,
    MessagesRoutes,
    EmbeddingRoutes,
    RenderRoutes,
    InfoRoutes,
    TokenRoutes,
    LoraRoutes,
    ProfileRoutes,
):
    """OpenAI-compatible HTTP server over `vsurge_map` (a vSurge, or {served name: vSurge}).

    `max_workers` (the seed's thread pool): threads for the work the server takes off its event loop
    (token counting, chat templates and tokenization of long prompts, /metrics, stopping the engines);
    requests themselves are served by the event loop. `oai_like_processor` (the seed's): a multimodal
    processor (a transformers ProcessorMixin) gets message content as OpenAI's list of typed parts, as its
    chat template reads it; False, or a plain tokenizer: content is a string.

    Split by job: Lifecycle (lifecycle.py), GenerationRoutes (generation.py), InfoRoutes (info_routes.py),
    TokenRoutes (token_routes.py); this class holds the shared state, the request helpers and the app.
    """

    def __init__(
        self,
        vsurge_map: Mapping[str, Any] | Any = None,
        max_workers: int = 10,
        oai_like_processor: bool = True,
        *,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        tracer_provider: Any = None,
        metrics_on_main_port: bool = False,
        drain_timeout_s: float = 300.0,
        owns_engines: bool = True,
        tool_call_parser: str | None = None,
        lora_runtime_updates: bool = False,
        admin_key: str | None = None,
        profile_dir: str | None = None,
    ) -> None:
        from .tool_parsers import PARSERS

        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        self.max_workers = max_workers
        self.oai_like_processor = bool(oai_like_processor)
        self.thread_pool: concurrent.futures.ThreadPoolExecutor | None = None  # while the app runs
        self.metrics_enabled = True  # fire(metrics_port=-1) turns it off
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}"
            )
        # tool_choice "auto": the parser of the model's tool-call format (None: read from the chat template)
        self.tool_call_parser = tool_call_parser
        # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer (lora_routes.py)
        self.lora_runtime_updates = lora_runtime_updates
        # those routes' own key (lora_routes.py): the API key does not open them where one is set
        self.admin_key = admin_key or None
        # POST /debug/profile writes its traces here (profile_routes.py; None: the route is off)
        self.profile_dir = profile_dir or None
        if self.profile_dir is not None:
            Path(self.profile_dir).mkdir(parents=True, exist_ok=True)  # unwritable: fail at start, not later
        self._profiling = threading.Lock()
        self.models: dict[str, ServedModel] = {}
        # /v1/responses' stored responses (store: true, previous_response_id), in memory
        self.responses_store = ResponseStore()
        self.api_key = api_key or None
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError("admin_key must differ from api_key: the admin routes need a key of their own")
        self._say_how_admin_routes_are_guarded()
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics()
        self.metrics.set_ready_probe(lambda: self.state == READY)
        self.metrics.in_flight.set_function(lambda: self.in_flight)
        # An explicit provider (tests, embedding apps) wins; otherwise the OTEL_* environment decides.
        self.tracing = Tracing(tracer_provider) if tracer_provider is not None else Tracing.from_env()
        self.metrics_on_main_port = metrics_on_main_port
        self.drain_timeout_s = drain_timeout_s
        # False when the caller shares the engines with other servers (tests): shutdown leaves them running.
        self.owns_engines = owns_engines
        self.state = STARTING
        self.state_reason = "models are loading and compiling"
        self.in_flight = 0
        self.drain_started_at: float | None = None
        self.fatal: BaseException | None = None
        self._lock = threading.Lock()
        if vsurge_map is not None:
            items = vsurge_map.items() if isinstance(vsurge_map, Mapping) else [(vsurge_map.name, vsurge_map)]
            for name, surge in items:
                self.add_model(name, surge)
        self.app = self._build_app()

    def _build_app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
            Route("/v1/completions/render", self.render_completion, methods=["POST"]),
            Route("/invocations", self.invocations, methods=["POST"]),
            Route("/v1/responses", self.responses_create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.responses_get, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.responses_delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.responses_cancel, methods=["POST"]),
            Route("/v1/messages", self.messages_create, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.messages_count_tokens, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/pooling", self.pooling, methods=["POST"]),
            Route("/v1/models", self.available_inference, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
            Route("/v1/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            Route("/load", self.load, methods=["GET"]),
            Route("/ping", self.ping, methods=["GET", "POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/liveness", self.liveness, methods=["GET"]),
            Route("/readiness", self.readiness, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/debug/profile", self.debug_profile, methods=["POST"]),
        ]

        @asynccontextmanager
        async def lifespan(app: Starlette):
            # every asyncio.to_thread of this loop (the server's and vSurge's offloads) runs in this pool
            self.thread_pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, "vsurge-api")
            asyncio.get_running_loop().set_default_executor(self.thread_pool)
            yield
            # uvicorn is done with every connection: stop the engines off the loop (threads join).
            await asyncio.to_thread(self.stop_engines)
            self.tracing.shutdown()

        async def http_error(request: Request, exc: Exception) -> Response:
            status = getattr(exc, "status_code", 500)
            if status == 404:
                err = APIError(
                    404, f"Unknown route: {request.method} {request.url.path}", code="unknown_route"
                )
            elif status == 405:
                err = APIError(
                    405,
                    f"Method {request.method} is not allowed on {request.url.path}",
                    code="method_not_allowed",
                )
            else:
                err = APIError(status, str(getattr(exc, "detail", "")) or "HTTP error")
            return _error_response(err)

        return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})

    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header and "x-api-key" in request.headers:  # the anthropic client's header (/v1/messages)
            scheme, token = "bearer", request.headers["x-api-key"]
        # compare_digest on bytes: constant time in the key's length, no early exit on the first mismatch
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise errors.unauthorized()

    def _model(self, name: str | None) -> ServedModel:
        """The model a request names; none named (vLLM's optional `model`): the first one served."""
        if name is None:
            if not self.models:
                raise errors.model_not_found("")
            return next(iter(self.models.values()))
        entry = self.models.get(name) or find_adapter(self.models, name)  # a base model, or an adapter
        if entry is None:
            raise errors.model_not_found(name)
        return entry

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > _DRAIN_CAP_BYTES:
            raise errors.body_too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > _DRAIN_CAP_BYTES:
                break
            if size <= limit:
                chunks.append(chunk)
        if size > limit:
            raise errors.body_too_large(limit)
        return b"".join(chunks)

    async def _json(self, request: Request) -> dict[str, Any]:
        return read_json(await self._read_body(request))

    def _record(self, model: str, route: str, status: int) -> None:
        self.metrics.record_http(model, route, status)

    def fire(
        self,
        host: str = "0.0.0.0",
        port: int = 11556,
        metrics_port: int | None = None,
        log_level: str = "info",
        ssl_keyfile: str | None = None,
        ssl_certfile: str | None = None,
        **kw: Any,
    ) -> None:
        """Run the server until SIGTERM/SIGINT (drains first); the seed's signature. See runner.serve.

        ``metrics_port``: the Prometheus port; None, ``port + 1``; -1 (the seed's): no /metrics at all. To
        serve /metrics on the main port instead, build the server with ``metrics_on_main_port=True``."""
        from .runner import serve

        if metrics_port == -1:
            kw["serve_metrics"] = False
        elif self.metrics_on_main_port:
            metrics_port = -1  # runner.start's value for "on the main port"
        serve(
            self,
            host=host,
            port=port,
            metrics_port=metrics_port,
            log_level=log_level,
            ssl_keyfile=ssl_keyfile,
            ssl_certfile=ssl_certfile,
            **kw,
        )


__all__ = ["DRAINING", "READY", "STARTING", "STOPPED", "ServedModel", "vSurgeApiServer"]
