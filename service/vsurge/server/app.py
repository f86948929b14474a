"""vSurgeApiServer: the OpenAI-compatible Starlette app in front of one or several vSurge engines.

Routes are thin: parse (parsing.py) -> run on vSurge -> shape (shaping.py). The server owns the state the
probes report (starting -> ready -> draining), the in-flight count that drain waits for, the metrics
registry and the tracer.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vsurge.request import vSurgeMetadata, vSurgeRequest

from . import errors
from .errors import APIError
from .metrics import CONTENT_TYPE, ServerMetrics
from .parsing import (
    GenerationPlan,
    messages_to_dicts,
    plan_chat,
    plan_completion,
    read_json,
    render_chat,
    validate,
)
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .shaping import (
    SSE_DONE,
    ChunkWriter,
    Collector,
    Extras,
    TokenDecoder,
    chat_response,
    completion_response,
    dumps,
    new_id,
)
from .streams import ClientDisconnected, SSEResponse, engine_events, run_until_disconnect
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

STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"


@dataclass
class ServedModel:
    """One served model: the engine and what the routes need from it, looked up once."""

    name: str
    surge: Any
    processor: Any
    max_length: int
    vocab_size: int | None
    decode: TokenDecoder
    created: int = field(default_factory=lambda: int(time.time()))
    load_seconds: float | None = None


def _vocab_size(surge: Any) -> int | None:
    # The model's embedding rows bound valid ids; the tokenizer may know fewer (padded vocabularies).
    try:
        return int(surge.driver.engines[0].config.vocab_size)
    except Exception:
        processor = getattr(surge, "processor", None)
        return len(processor) if processor is not None else None


_Req = TypeVar("_Req", CountTokensRequest, TokenizeRequest, DetokenizeRequest)
_Route = Callable[[Any, Request], Awaitable[Response]]


def _answers_api_errors(route: _Route) -> _Route:
    """For routes outside generation: an APIError raised anywhere in `route` becomes its JSON answer."""

    @functools.wraps(route)
    async def answer(self: Any, request: Request) -> Response:
        try:
            return await route(self, request)
        except APIError as e:
            return _error_response(e)
        except Exception as e:  # never a plain-text 500 (and a reset kept-alive connection)
            err = errors.from_exception(e)
            if err.status >= 500:
                log.exception("%s failed", request.url.path)
            return _error_response(err)

    return answer


def _tokenizer(entry: ServedModel) -> Any:
    if entry.processor is None:
        raise errors.invalid_request("This model has no tokenizer.", param="model")
    return entry.processor


class vSurgeApiServer:  # noqa: N801 - the seed's name
    """OpenAI-compatible HTTP server over `vsurge_map` (a vSurge, or {served name: vSurge}).

    `max_workers` and `oai_like_processor` are accepted for the seed's signature; the server is fully async
    and always applies the model's own chat template.
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
    ) -> None:
        self.models: dict[str, ServedModel] = {}
        self.api_key = api_key or None
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
            items = (
                vsurge_map.items()
                if isinstance(vsurge_map, Mapping)
                else [(vsurge_map.vsurge_name, vsurge_map)]
            )
            for name, surge in items:
                self.add_model(name, surge)
        self.app = self._build_app()

    # ------------------------------------------------------------------------------ models & state
    def add_model(self, name: str, surge: Any, *, load_seconds: float | None = None) -> ServedModel:
        """Serve `surge` as `name`; it answers requests once the server is ready."""
        if name in self.models:
            raise ValueError(f"a model named {name!r} is already served")
        entry = ServedModel(
            name=name,
            surge=surge,
            processor=surge.processor,
            max_length=int(surge.max_length),
            vocab_size=_vocab_size(surge),
            decode=TokenDecoder(surge.processor),
            load_seconds=load_seconds,
        )
        self.models[name] = entry
        self.metrics.add_model(name, surge)
        if load_seconds is not None:
            self.metrics.load_seconds.labels(name, "total").set(load_seconds)
        return entry

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile every shape of every model (blocking), start the engines, then report ready."""
        for name, entry in list(self.models.items()):
            say = progress or (lambda msg: None)
            say(f"compiling {name}")
            t0 = time.perf_counter()
            entry.surge.compile(progress)
            seconds = time.perf_counter() - t0
            self.metrics.compile_seconds.labels(name).set(seconds)
            self.metrics.load_seconds.labels(name, "compile").set(seconds)
            say(f"compiled {name} in {seconds:.1f}s")
            entry.surge.start()
        self.mark_ready()

    def mark_ready(self) -> None:
        """For engines compiled and started by the caller: open for traffic."""
        if self.state == STARTING:
            self.state, self.state_reason = READY, ""

    def begin_drain(self, reason: str = "the server is shutting down") -> None:
        """Readiness goes false and new generations get 503; requests in flight run to the end."""
        if self.state in (DRAINING, STOPPED):
            return
        log.info("draining: %d request(s) in flight", self.in_flight)
        self.state, self.state_reason = DRAINING, reason
        self.drain_started_at = time.monotonic()

    def drain_complete(self) -> bool:
        """True once a drain has no request left in flight (or its timeout passed)."""
        if self.fatal is not None:
            return True
        if self.state != DRAINING or self.drain_started_at is None:
            return False
        if self.in_flight == 0:
            return True
        return time.monotonic() - self.drain_started_at > self.drain_timeout_s

    def stop_engines(self) -> None:
        self.state = STOPPED
        if not self.owns_engines:
            return
        for entry in self.models.values():
            try:
                entry.surge.stop()
            except Exception:
                log.exception("stopping %s failed", entry.name)

    # ------------------------------------------------------------------------------ app
    def _build_app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.available_inference, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
            Route("/v1/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/liveness", self.liveness, methods=["GET"]),
            Route("/readiness", self.readiness, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ]

        @asynccontextmanager
        async def lifespan(app: Starlette):
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

    # ------------------------------------------------------------------------------ helpers
    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest on bytes: constant time in the key's length, no early exit on the first mismatch
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise errors.unauthorized()

    def _check_ready(self) -> None:
        if self.state != READY:
            raise errors.not_ready(self.state_reason or self.state)

    def _model(self, name: str) -> ServedModel:
        entry = self.models.get(name)
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

    # ------------------------------------------------------------------------------ generation
    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._generate(request, "text_completion")

    async def _plan(self, request: Request, operation: str) -> tuple[ServedModel, GenerationPlan]:
        data = await self._json(request)
        if operation == "chat":
            req = validate(ChatCompletionRequest, data)
            entry = self._model(req.model)
            big = (
                sum(len(m.content) if isinstance(m.content, str) else 0 for m in req.messages)
                > _OFFLOAD_CHARS
            )
            args = (req, entry.processor)
            kw = {"max_length": entry.max_length, "vocab_size": entry.vocab_size}
            plan = await asyncio.to_thread(plan_chat, *args, **kw) if big else plan_chat(*args, **kw)
        else:
            req = validate(CompletionRequest, data)
            entry = self._model(req.model)
            plan = plan_completion(req, max_length=entry.max_length, vocab_size=entry.vocab_size)
            if plan.echo:
                plan.prompt_texts = [p if isinstance(p, str) else _decode(entry, p) for p in plan.prompts]
        return entry, plan

    def _engine_requests(self, plan: GenerationPlan, response_id: str) -> list[vSurgeRequest]:
        out = []
        for i, prompt in enumerate(plan.prompts):
            ids = isinstance(prompt, list)
            extra = {"detokenize": True} if ids else {}  # a completion owes text even for token-id prompts
            md = vSurgeMetadata(id=response_id if len(plan.prompts) == 1 else f"{response_id}-{i}")
            out.append(
                vSurgeRequest.from_sampling_params(
                    prompt,
                    plan.sampling,
                    metadata=md,
                    is_client_side_tokenization=ids,
                    strict_max_tokens=plan.strict_max_tokens,
                    **extra,
                )
            )
        return out

    async def _generate(self, request: Request, operation: str) -> Response:
        route = request.url.path
        model_name = ""
        span = None
        counted = False
        try:
            self._check_auth(request)
            self._check_ready()
            self.in_flight += 1
            counted = True
            entry, plan = await self._plan(request, operation)
            model_name = entry.name
            response_id = new_id("chatcmpl" if operation == "chat" else "cmpl")
            created = int(time.time())
            if self.tracing.enabled:
                sp = plan.sampling
                span = self.tracing.start(
                    operation,
                    entry.name,
                    request.headers,
                    {
                        "gen_ai.request.max_tokens": sp.max_tokens,
                        "gen_ai.request.temperature": sp.temperature,
                        "gen_ai.request.top_p": sp.top_p,
                        "gen_ai.request.top_k": sp.top_k or None,
                        "gen_ai.request.seed": sp.seed,
                        "gen_ai.request.choice.count": sp.n if sp.n != 1 else None,
                        "gen_ai.request.presence_penalty": sp.presence_penalty or None,
                        "gen_ai.request.frequency_penalty": sp.frequency_penalty or None,
                        "gen_ai.request.stop_sequences": list(sp.stop) if sp.stop else None,
                        "vsurge.request.stream": plan.stream,
                    },
                )
            engine_reqs = self._engine_requests(plan, response_id)
            if plan.stream:
                response = await self._stream(request, entry, plan, engine_reqs, response_id, created, span)
                counted = False  # the stream's cleanup owns the count and the span now
                span = None
                return response
            body = await self._complete(request, entry, plan, engine_reqs, response_id, created, span)
            span = None
            self._record(model_name, route, 200)
            return Response(body, media_type="application/json")
        except ClientDisconnected:
            # Nobody to answer; 499 is nginx's "client closed request", for the counter only.
            self._record(model_name, route, 499)
            if span is not None:
                self.tracing.finish(
                    span, error=APIError(499, "client disconnected", code="client_disconnected")
                )
            return Response(b"", status_code=499)
        except Exception as exc:
            err = errors.from_exception(exc)
            if err.status == 400 and err.code == "context_length_exceeded" and operation != "chat":
                err.param = "prompt"
            if err.status >= 500 and not isinstance(exc, APIError):
                log.exception("%s failed", route)
            self._record(model_name, route, err.status)
            if span is not None:
                self.tracing.finish(span, error=err)
            return _error_response(err)
        finally:
            if counted:
                self.in_flight -= 1

    async def _complete(
        self,
        request: Request,
        entry: ServedModel,
        plan: GenerationPlan,
        engine_reqs: list[vSurgeRequest],
        response_id: str,
        created: int,
        span: Any,
    ) -> bytes:
        n = plan.sampling.n
        collectors = [Collector(n, index_offset=i * n) for i in range(len(engine_reqs))]

        async def collect() -> None:
            events = engine_events(entry.surge, engine_reqs)
            try:
                async for i, samples in events:
                    collectors[i].add(samples)
            finally:
                await events.aclose()

        await run_until_disconnect(request.receive, collect())
        choices = [c for col in collectors for c in col.choices]
        owners = [col for col in collectors for _ in col.choices]
        prompt_tokens = sum(col.prompt_tokens for col in collectors)
        sp = plan.sampling
        extras = Extras(
            return_token_ids=plan.return_token_ids,
            prompt_logprobs=plan.show_prompt_logprobs,
            cached_tokens=sum(col.cached_tokens for col in collectors),
        )
        if plan.operation == "chat":
            obj = chat_response(
                response_id,
                created,
                entry.name,
                choices,
                prompt_tokens,
                entry.decode,
                sp.logprobs,
                collector=collectors[0],
                extras=extras,
            )
        else:
            echo = None
            if plan.echo:
                echo = [plan.prompt_texts[c.index // n] for c in choices]
            obj = completion_response(
                response_id,
                created,
                entry.name,
                choices,
                prompt_tokens,
                entry.decode,
                sp.logprobs,
                echo_prefixes=echo,
                collectors=owners,
                extras=extras,
            )
        if span is not None:
            self.tracing.finish(
                span,
                response_id=response_id,
                response_model=entry.name,
                finish_reasons=[c.finish_reason for c in choices],
                input_tokens=prompt_tokens,
                output_tokens=obj["usage"]["completion_tokens"],
                metadata=engine_reqs[0].metadata,
            )
        return dumps(obj)

    async def _stream(
        self,
        request: Request,
        entry: ServedModel,
        plan: GenerationPlan,
        engine_reqs: list[vSurgeRequest],
        response_id: str,
        created: int,
        span: Any,
    ) -> Response:
        sp = plan.sampling
        n = sp.n
        writer = ChunkWriter(
            operation=plan.operation,
            response_id=response_id,
            created=created,
            model=entry.name,
            decode=entry.decode,
            with_logprobs=sp.logprobs,
            with_top=plan.operation != "chat" or sp.top_logprobs > 0,
            include_usage=plan.include_usage,
            continuous_usage=plan.continuous_usage,
            extras=Extras(return_token_ids=plan.return_token_ids, prompt_logprobs=plan.show_prompt_logprobs),
            echo_texts=[plan.prompt_texts[k // n] for k in range(n * len(engine_reqs))]
            if plan.echo
            else None,
        )
        events = engine_events(entry.surge, engine_reqs)
        # Pull the first item before answering 200: a full queue or a too-long prompt must still get its
        # own status code (429 / 400), not an error inside a 200 stream.
        try:
            first = await run_until_disconnect(request.receive, events.__anext__())
        except StopAsyncIteration:
            first = None
        except BaseException:
            await events.aclose()
            raise
        finish_reasons: dict[int, str] = {}
        route = request.url.path

        def frames(item: tuple[int, list[Any]]) -> bytes:
            i, samples = item
            for s in samples:
                if s.finish_reason is not None:
                    finish_reasons[i * n + s.index] = s.finish_reason
            return writer.frames(samples, index_offset=i * n, request_key=i)

        async def body():
            head = writer.role_frames(range(n * len(engine_reqs)))
            if first is not None:
                head += frames(first)
            yield head
            try:
                async for item in events:
                    yield frames(item)
            except Exception as exc:  # after the 200, an error can only travel in-band
                err = errors.from_exception(exc)
                outcome["error"] = err
                yield writer.error_frame(err.body())
                yield SSE_DONE
                return
            yield writer.usage_frame() + SSE_DONE

        outcome: dict[str, Any] = {}

        async def cleanup(disconnected: bool) -> None:
            await events.aclose()  # cancels the engine requests if they are still running
            self.in_flight -= 1
            err = outcome.get("error")
            status = 499 if disconnected else (err.status if err else 200)
            self._record(entry.name, route, status)
            if span is not None:
                if disconnected and err is None:
                    err = APIError(499, "client disconnected", code="client_disconnected")
                prompt_tokens = sum(writer.prompt_tokens.values())
                self.tracing.finish(
                    span,
                    response_id=response_id,
                    response_model=entry.name,
                    finish_reasons=[finish_reasons[k] for k in sorted(finish_reasons)],
                    input_tokens=prompt_tokens,
                    output_tokens=sum(writer.generated.values()),
                    metadata=engine_reqs[0].metadata,
                    error=err,
                )

        return SSEResponse(body(), cleanup=cleanup)

    # ------------------------------------------------------------------------------ other routes
    async def _model_request(self, request: Request, schema: type[_Req]) -> tuple[_Req, ServedModel]:
        """Authorize, then read the body as `schema` and look up the model it names."""
        self._check_auth(request)
        req = validate(schema, await self._json(request))
        return req, self._model(req.model)

    @_answers_api_errors
    async def available_inference(self, request: Request) -> Response:
        """GET /v1/models."""
        self._check_auth(request)
        return JSONResponse({"object": "list", "data": [_model_card(m) for m in self.models.values()]})

    @_answers_api_errors
    async def get_model(self, request: Request) -> Response:
        """GET /v1/models/{id}."""
        self._check_auth(request)
        return JSONResponse(_model_card(self._model(request.path_params["model_id"])))

    @_answers_api_errors
    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/count_tokens (the seed's): {"model", "conversation": str | messages} -> {"model", "count"}."""
        req, entry = await self._model_request(request, CountTokensRequest)
        if isinstance(req.conversation, str):
            conv: Any = req.conversation
        else:
            conv = messages_to_dicts(req.conversation, param="conversation")
        try:
            count = await asyncio.to_thread(entry.surge.count_tokens, conv)
        except ValueError as e:
            raise errors.invalid_request(str(e), param="conversation") from None
        return JSONResponse({"model": entry.name, "count": count})

    @_answers_api_errors
    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: {"model", "prompt"} or {"model", "messages"} -> {"count", "max_model_len", "tokens"}."""
        req, entry = await self._model_request(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise errors.invalid_request("Send exactly one of 'prompt' or 'messages'.", param="prompt")
        processor = _tokenizer(entry)
        if req.messages is not None:
            text = render_chat(
                processor,
                messages_to_dicts(req.messages),
                add_generation_prompt=True
                if req.add_generation_prompt is None
                else req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
            )
        else:
            text = req.prompt or ""
        if req.add_special_tokens is None:
            # Same rule the engine uses, so /tokenize counts what generation will see.
            tokens = await asyncio.to_thread(entry.surge.tokenize, text) if text else []
        else:
            tokens = list(processor.encode(text, add_special_tokens=req.add_special_tokens))
        return JSONResponse({"count": len(tokens), "max_model_len": entry.max_length, "tokens": tokens})

    @_answers_api_errors
    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize: {"model", "tokens"} -> {"prompt"}."""
        req, entry = await self._model_request(request, DetokenizeRequest)
        processor = _tokenizer(entry)
        limit = len(processor)
        bad = next((t for t in req.tokens if not (0 <= t < limit)), None)
        if bad is not None:
            raise errors.invalid_request(
                f"'tokens' contains {bad}, outside the tokenizer's {limit} tokens.", param="tokens"
            )
        return JSONResponse({"prompt": processor.decode(req.tokens)})

    async def liveness(self, request: Request) -> Response:
        """GET /liveness: the process and its event loop answer; fails only if an engine died while serving."""
        dead = self._dead_engines()
        if dead:
            return JSONResponse({"status": "dead", "engines": dead}, status_code=503)
        return JSONResponse({"status": "alive"})

    async def readiness(self, request: Request) -> Response:
        """GET /readiness: 200 only when compiled, started and not draining."""
        if self.state == READY and not self._dead_engines():
            return JSONResponse({"status": "ready"})
        return _error_response(errors.not_ready(self.state_reason or self.state))

    async def health(self, request: Request) -> Response:
        """GET /health: state and per-model slot figures, for humans and dashboards."""
        models = {}
        for name, entry in self.models.items():
            try:
                m = entry.surge.metrics()
                models[name] = {
                    "slots_used": m.slots_used,
                    "slots_total": m.slots_total,
                    "requests_waiting": m.requests_waiting,
                    "max_length": entry.max_length,
                }
            except Exception as e:
                models[name] = {"error": type(e).__name__}
        dead = self._dead_engines()
        status = "dead" if dead else self.state
        return JSONResponse(
            {"status": status, "in_flight": self.in_flight, "models": models},
            status_code=503 if dead else 200,
        )

    async def metrics_route(self, request: Request) -> Response:
        """GET /metrics on the main port (when the metrics port is -1)."""
        if not self.metrics_on_main_port:
            return _error_response(
                APIError(404, "Metrics are served on the metrics port.", code="unknown_route")
            )
        data = await asyncio.to_thread(self.metrics.render)
        return Response(data, media_type=CONTENT_TYPE)

    def _dead_engines(self) -> list[str]:
        if self.state != READY:
            return []
        out = []
        for name, entry in self.models.items():
            live = getattr(getattr(entry.surge, "driver", None), "live", True)
            if not live:
                out.append(name)
        return out

    # ------------------------------------------------------------------------------ running
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
        """Run the server until SIGTERM/SIGINT (drains first); the seed's signature. See runner.serve."""
        from .runner import serve

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


def _decode(entry: ServedModel, ids: list[int]) -> str:
    return entry.processor.decode(ids) if entry.processor is not None else ""


def _model_card(m: ServedModel) -> dict[str, Any]:
    return {
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": "vsurge",
        "max_model_len": m.max_length,
    }


def _error_response(err: APIError) -> Response:
    return Response(
        err.body_bytes(), status_code=err.status, media_type="application/json", headers=err.headers
    )
