"""The routes beside generation: models, token counting, probes, health and metrics."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import errors
from .engine import ServedModel, _error_response, _model_card
from .errors import APIError
from .lifecycle import READY
from .metrics import CONTENT_TYPE
from .parsing import (
    messages_to_dicts,
    render_chat,
    validate,
)
from .schemas import (
    CountTokensRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

log = logging.getLogger(__name__)

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


class InfoRoutes:
    """Models, tokens, probes and metrics: every route but generation. A mixin of vSurgeApiServer."""

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
        if self.state == READY and self.stop_announced:
            return _error_response(errors.not_ready(self.stop_announced))
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
