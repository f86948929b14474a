"""The generation routes: chat and text completions, streamed or not."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from vsurge.request import vSurgeMetadata, vSurgeRequest

from . import errors
from .engine import ServedModel, _decode, _error_response
from .errors import APIError
from .parsing import (
    GenerationPlan,
    plan_chat,
    plan_completion,
    validate,
)
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
)
from .shaping import (
    SSE_DONE,
    ChunkWriter,
    Collector,
    Extras,
    chat_response,
    completion_response,
    dumps,
    new_id,
)
from .streams import ClientDisconnected, SSEResponse, engine_events, run_until_disconnect
from .structured_outputs import compile_spec
from .tool_parsers import resolve_choice

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)

# Large enough for a 128k-token prompt as JSON, small enough that a hostile body cannot exhaust memory.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Bodies up to this size are read to the end before a 413, so the client sees the answer rather than a
# connection reset while it is still uploading.
_DRAIN_CAP_BYTES = 64 * 1024 * 1024
# Prompts above this many characters are chat-templated off the event loop, so one huge request does not
# stall every stream.
_OFFLOAD_CHARS = 65536


class GenerationRoutes:
    """POST /v1/chat/completions and /v1/completions: parse, plan, run on the engine, shape (or stream).

    A mixin of vSurgeApiServer (uses its request helpers, models, metrics and tracing).
    """

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
            kw = {
                "max_length": entry.max_length,
                "vocab_size": entry.vocab_size,
                "tool_call_parser": getattr(self, "tool_call_parser", None),
            }
            plan = await asyncio.to_thread(plan_chat, *args, **kw) if big else plan_chat(*args, **kw)
        else:
            req = validate(CompletionRequest, data)
            entry = self._model(req.model)
            plan = plan_completion(req, max_length=entry.max_length, vocab_size=entry.vocab_size)
            if plan.echo:
                plan.prompt_texts = [p if isinstance(p, str) else _decode(entry, p) for p in plan.prompts]
        if plan.grammar is not None:  # compiled once per schema, off the event loop; errors are 400s
            plan.sampling.grammar = await compile_spec(entry, plan.grammar)
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
            if plan.tools is not None:
                for c in choices:
                    c.content, c.tool_calls, c.finish_reason = resolve_choice(
                        c.text, c.finish_reason, plan.tools
                    )
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
        tool_mode = plan.tools is not None and plan.tools.choice != "none"
        tool_text: dict[int, list[str]] = {}

        def tool_frames(i: int, samples: list[Any]) -> bytes:
            # tool calls are parsed from the whole text: hold the text back, answer at the finish
            out = []
            for s in samples:
                k = i * n + s.index
                tool_text.setdefault(k, []).append(s.text)
                quiet = dataclasses.replace(s, text="", logprobs=None, finish_reason=None)
                out.append(writer.frames([quiet], index_offset=i * n, request_key=i))
                if s.finish_reason is not None:
                    content, calls, finish = resolve_choice(
                        "".join(tool_text[k]), s.finish_reason, plan.tools
                    )
                    finish_reasons[k] = finish
                    out.append(writer.tool_call_frames(k, content, calls or [], finish))
            return b"".join(out)

        def frames(item: tuple[int, list[Any]]) -> bytes:
            i, samples = item
            if tool_mode:
                return tool_frames(i, samples)
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
