"""What the routes that speak another API over chat share (/v1/responses, /v1/messages): the bookkeeping of
one call (auth, readiness, the in-flight count, the metrics counter, the span, the error answer) and one
chat plan run on the engine, whole or as text deltas.

Those routes translate their body into a chat-completions body and plan it with `GenerationRoutes._plan`,
so the chat template, structured output and tool parsing are the very ones /v1/chat/completions uses.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from . import errors
from .errors import APIError
from .parsing import GenerationPlan
from .served_model import ServedModel, _error_response
from .shaping import Collector
from .streams import ClientDisconnected, engine_events, run_until_disconnect
from .tool_parsers import resolve_choice

log = logging.getLogger(__name__)


@dataclass
class Call:
    """One request on a translated route: counted in flight once admitted, recorded and traced once."""

    server: Any
    request: Request
    # maps a chat field the planner named (messages, max_tokens, ...) to the field of this API
    param_names: Mapping[str, str] = field(default_factory=dict)
    model: str = ""
    span: Any = None
    counted: bool = False
    closed: bool = False
    # the metrics' route label when the path holds an id (/v1/responses/{response_id}): bounded labels
    label: str | None = None

    @property
    def route(self) -> str:
        return self.label or self.request.url.path

    def admit(self) -> None:
        """Auth and readiness (raise the client's error), then count the request in flight."""
        self.server._check_auth(self.request)
        self.server._check_ready()
        self.server.in_flight += 1
        self.counted = True

    def start_span(
        self, operation: str, entry: ServedModel | str, plan: GenerationPlan | None = None
    ) -> None:
        """A span `{operation} {model}` (the GenAI attributes of the plan when there is one)."""
        if not self.server.tracing.enabled:
            return
        attrs: dict[str, Any] = {"vsurge.request.route": self.route}
        if plan is not None:
            sp = plan.sampling
            attrs.update(
                {
                    "gen_ai.request.max_tokens": sp.max_tokens,
                    "gen_ai.request.temperature": sp.temperature,
                    "gen_ai.request.top_p": sp.top_p,
                    "gen_ai.request.stop_sequences": list(sp.stop) if sp.stop else None,
                    "vsurge.request.stream": plan.stream,
                }
            )
        name = entry if isinstance(entry, str) else entry.name
        self.span = self.server.tracing.start(operation, name, self.request.headers, attrs)

    def close(self, status: int, error: APIError | None = None, **finish: Any) -> None:
        """Record the status, end the span, leave the in-flight count; only the first call counts."""
        if self.closed:
            return
        self.closed = True
        self.server._record(self.model, self.route, status)
        if self.span is not None:
            if error is None and status == 499:
                error = APIError(499, "client disconnected", code="client_disconnected")
            self.server.tracing.finish(self.span, error=error, **finish)
        if self.counted:
            self.server.in_flight -= 1

    def fail(self, exc: BaseException, shape: Callable[[APIError], Response] | None = None) -> Response:
        """The error answer of `exc` (an APIError, or an engine exception mapped to one), recorded."""
        if isinstance(exc, ClientDisconnected):
            self.close(499)
            return Response(b"", status_code=499)
        err = errors.from_exception(exc)
        if err.param in self.param_names:
            err.param = self.param_names[err.param]
        elif err.param and "." in err.param and err.param.split(".")[0] in self.param_names:
            head, _, rest = err.param.partition(".")
            err.param = f"{self.param_names[head]}.{rest}"
        if err.status >= 500 and not isinstance(exc, APIError):
            log.exception("%s failed", self.route)
        self.close(err.status, err)
        return shape(err) if shape is not None else _error_response(err)


@dataclass
class ChatOutcome:
    """One finished chat choice, tool calls resolved, with the usage a response reports."""

    text: str
    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # the generated ids, a stop string's tokens included (what tells which stop sequence ended it)
    token_ids: list[int] = field(default_factory=list)


def outcome_of(col: Collector, plan: GenerationPlan) -> ChatOutcome:
    c = col.choices[0]
    content, calls, finish = c.text, None, c.finish_reason
    if plan.tools is not None:
        content, calls, finish = resolve_choice(c.text, c.finish_reason, plan.tools)
    return ChatOutcome(
        c.text, content, calls, finish, col.prompt_tokens, col.cached_tokens, c.generated_tokens, c.token_ids
    )


class ChatRuns:
    """A mixin of vSurgeApiServer: one planned chat (n = 1) run whole or streamed."""

    def _call(self, request: Request, param_names: Mapping[str, str] | None = None) -> Call:
        return Call(self, request, dict(param_names or {}))

    async def _chat_plan(self, body: dict[str, Any]) -> tuple[ServedModel, GenerationPlan]:
        return await self._plan(body, "chat")  # type: ignore[attr-defined] - GenerationRoutes

    async def _run_chat(
        self, request: Request, entry: ServedModel, plan: GenerationPlan, response_id: str
    ) -> tuple[ChatOutcome, Any]:
        """Run to the end (a client that leaves cancels it); (outcome, the engine request's metadata)."""
        reqs = self._engine_requests(plan, response_id)  # type: ignore[attr-defined]
        col = Collector(1)

        async def collect() -> None:
            events = engine_events(entry.surge, reqs)
            try:
                async for _, samples in events:
                    col.add(samples)
            finally:
                await events.aclose()

        await run_until_disconnect(request.receive, collect())
        return outcome_of(col, plan), reqs[0].metadata

    async def _chat_deltas(
        self, request: Request, entry: ServedModel, plan: GenerationPlan, response_id: str
    ) -> tuple[AsyncIterator[tuple[str, Collector]], Any]:
        """(text deltas with the collector so far, metadata). The first engine event is awaited here, so a
        full queue or a too-long prompt is still an error status, not an error inside a 200 stream.
        Closing the iterator cancels the engine request."""
        reqs = self._engine_requests(plan, response_id)  # type: ignore[attr-defined]
        events = engine_events(entry.surge, reqs)
        col = Collector(1)
        try:
            first = await run_until_disconnect(request.receive, events.__anext__())
        except StopAsyncIteration:
            first = None
        except BaseException:
            await events.aclose()
            raise

        async def deltas() -> AsyncIterator[tuple[str, Collector]]:
            try:
                if first is not None:
                    col.add(first[1])
                    yield "".join(s.text for s in first[1]), col
                async for _, samples in events:
                    col.add(samples)
                    yield "".join(s.text for s in samples), col
            finally:
                await events.aclose()

        return deltas(), reqs[0].metadata
