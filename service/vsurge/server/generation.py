"""The generation routes: chat and text completions (streamed or not, sampled or beam-searched), and
SageMaker's /invocations, which dispatches to one of them by the body's shape."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from vsurge.contracts.request import GenerationRequest, ReturnSample, vSurgeMetadata

from . import beam_search, errors
from .errors import APIError
from .explicit_logprobs import named_events
from .parsing import GenerationPlan, plan_chat, plan_completion, validate
from .prompts import tokenize_prompts
from .schemas import ChatCompletionRequest, CompletionRequest
from .served_model import ServedModel, _decode, _error_response
from .shaping import (
    SSE_DONE,
    ChunkWriter,
    Collector,
    Extras,
    chat_response,
    completion_response,
    dumps,
    new_id,
    token_id_string,
)
from .streams import ClientDisconnected, SSEResponse, run_until_disconnect
from .structured_outputs import compile_spec
from .tool_parsers import resolve_choice

log = logging.getLogger(__name__)

# Prompts above this many characters are chat-templated (and tokenized) off the event loop, so one huge
# request does not stall every stream.
_OFFLOAD_CHARS = 65536


def _chars(prompts: list[Any]) -> int:
    return sum(len(p) for p in prompts if isinstance(p, str))


class GenerationRoutes:
    """POST /v1/chat/completions, /v1/completions and /invocations: parse, plan, run on the engine, shape
    (or stream). A mixin of vSurgeApiServer (uses its request helpers, models, metrics and tracing).
    """

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._generate(request, "text_completion")

    async def invocations(self, request: Request) -> Response:
        """POST /invocations (SageMaker's): a chat body ("messages") or a completions body ("prompt")."""
        return await self._generate(request, None)

    async def _plan(self, data: dict[str, Any], operation: str) -> tuple[ServedModel, GenerationPlan]:
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
                "oai_like_processor": getattr(self, "oai_like_processor", True),
            }
            plan = await asyncio.to_thread(plan_chat, *args, **kw) if big else plan_chat(*args, **kw)
        else:
            req = validate(CompletionRequest, data)
            entry = self._model(req.model)
            plan = plan_completion(req, max_length=entry.max_length, vocab_size=entry.vocab_size)
        await self._tokenize(entry, plan)
        if plan.echo:
            plan.prompt_texts = [p if isinstance(p, str) else _decode(entry, p) for p in plan.prompts]
        if plan.grammar is not None:  # compiled once per schema, off the event loop; errors are 400s
            plan.sampling.grammar = await compile_spec(entry, plan.grammar)
        return entry, plan

    async def _tokenize(self, entry: ServedModel, plan: GenerationPlan) -> None:
        """Server-side tokenization where an option needs it (truncation, add_special_tokens, beam search)."""
        named = bool(plan.logprob_token_ids)  # its scoring contexts start with the prompt's ids
        if plan.truncate_keep is None and plan.add_special_tokens is None and plan.beam is None and not named:
            return
        if entry.processor is None and any(isinstance(p, str) for p in plan.prompts):
            raise errors.invalid_request("This model has no tokenizer; send token ids.", param="prompt")
        processor = entry.processor

        def run() -> list[str | list[int]]:
            return tokenize_prompts(
                plan.prompts,
                tokenize=entry.surge.tokenize,
                encode=lambda text, special: list(processor.encode(text, add_special_tokens=special)),
                add_special_tokens=plan.add_special_tokens,
                keep=plan.truncate_keep,
                side=plan.truncation_side,
                always=plan.beam is not None or named,  # beams grow token ids
            )

        big = _chars(plan.prompts) > _OFFLOAD_CHARS
        plan.prompts = await asyncio.to_thread(run) if big else run()

    def _engine_requests(self, plan: GenerationPlan, response_id: str) -> list[GenerationRequest]:
        out = []
        for i, prompt in enumerate(plan.prompts):
            ids = isinstance(prompt, list)
            extra = {"detokenize": True} if ids else {}  # a completion owes text even for token-id prompts
            md = vSurgeMetadata(id=response_id if len(plan.prompts) == 1 else f"{response_id}-{i}")
            out.append(
                GenerationRequest(
                    prompt,
                    plan.sampling,
                    metadata=md,
                    is_client_side_tokenization=ids,
                    strict_max_tokens=plan.strict_max_tokens,
                    **extra,
                )
            )
        return out

    async def _generate(self, request: Request, operation: str | None) -> Response:
        route = request.url.path
        model_name = ""
        span = None
        counted = False
        try:
            self._check_auth(request)
            self._check_ready()
            self.in_flight += 1
            counted = True
            data = await self._json(request)
            if operation is None:
                operation = _invocation_kind(data)
                if operation == "embedding":  # the embeddings route owns its count and its answer
                    self.in_flight -= 1
                    counted = False
                    return await self._pool(request, "embedding", data)
            entry, plan = await self._plan(data, operation)
            model_name = entry.name
            response_id = new_id("chatcmpl" if operation == "chat" else "cmpl", plan.request_id)
            created = int(time.time())
            if self.tracing.enabled:
                span = self._start_span(request, operation, entry, plan)
            if plan.beam is not None:
                collectors = await run_until_disconnect(
                    request.receive, self._beam_search(entry, plan, response_id)
                )
                engine_reqs: list[GenerationRequest] = []
            else:
                collectors = None
                engine_reqs = self._engine_requests(plan, response_id)
            if plan.stream:
                response = await self._stream(
                    request, entry, plan, engine_reqs, response_id, created, span, collectors
                )
                counted = False  # the stream's cleanup owns the count and the span now
                span = None
                return response
            body = await self._complete(
                request, entry, plan, engine_reqs, response_id, created, span, collectors
            )
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

    def _start_span(self, request: Request, operation: str, entry: ServedModel, plan: GenerationPlan) -> Any:
        sp = plan.sampling
        return self.tracing.start(
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

    async def _beam_search(
        self, entry: ServedModel, plan: GenerationPlan, response_id: str
    ) -> list[Collector]:
        """Every prompt's beams (beam_search.py), as Collectors the usual shaping reads."""
        opts, surge = plan.beam, entry.surge
        eos = frozenset(int(t) for t in (getattr(surge, "eos_token_ids", None) or []))
        limit = int(getattr(surge, "max_prompt_length", entry.max_length - 1))

        async def one(i: int, prompt: list[int]) -> Collector:
            beams = await beam_search.search(
                surge,
                prompt,
                width=opts.width,
                max_tokens=plan.sampling.max_tokens,
                length_penalty=opts.length_penalty,
                ignore_eos=opts.ignore_eos,
                eos_ids=eos,
                max_prompt_length=limit,
                request_id=f"{response_id}-{i}",
            )
            col = Collector(opts.width, index_offset=i * opts.width)
            col.add(beam_search.beam_samples(beams, prompt, lambda ids: _decode(entry, ids)))
            return col

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(plan.prompts))))

    def _extras(self, plan: GenerationPlan, cached: int = 0) -> Extras:
        return Extras(
            return_token_ids=plan.return_token_ids,
            prompt_logprobs=plan.show_prompt_logprobs,
            cached_tokens=cached,
            tokens_as_ids=plan.tokens_as_ids,
            stop_token_ids=frozenset(plan.sampling.stop_token_ids or ()),
            echo=plan.chat_echo,
        )

    async def _complete(
        self,
        request: Request,
        entry: ServedModel,
        plan: GenerationPlan,
        engine_reqs: list[GenerationRequest],
        response_id: str,
        created: int,
        span: Any,
        collectors: list[Collector] | None = None,
    ) -> bytes:
        n = plan.beam.width if plan.beam is not None else plan.sampling.n
        if collectors is None:
            collectors = [Collector(n, index_offset=i * n) for i in range(len(engine_reqs))]

            async def collect() -> None:
                events = named_events(entry.surge, engine_reqs, plan.logprob_token_ids)
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
        extras = self._extras(plan, sum(col.cached_tokens for col in collectors))
        decode = token_id_string if plan.tokens_as_ids else entry.decode
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
                decode,
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
                decode,
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
                metadata=engine_reqs[0].metadata if engine_reqs else None,
            )
        return dumps(obj)

    async def _stream(
        self,
        request: Request,
        entry: ServedModel,
        plan: GenerationPlan,
        engine_reqs: list[GenerationRequest],
        response_id: str,
        created: int,
        span: Any,
        collectors: list[Collector] | None = None,
    ) -> Response:
        sp = plan.sampling
        n = plan.beam.width if plan.beam is not None else sp.n
        count = n * (len(collectors) if collectors is not None else len(engine_reqs))
        writer = ChunkWriter(
            operation=plan.operation,
            response_id=response_id,
            created=created,
            model=entry.name,
            decode=token_id_string if plan.tokens_as_ids else entry.decode,
            with_logprobs=sp.logprobs,
            with_top=plan.operation != "chat" or sp.top_logprobs > 0,
            include_usage=plan.include_usage,
            continuous_usage=plan.continuous_usage,
            extras=self._extras(plan),
            echo_texts=[plan.prompt_texts[k // n] for k in range(count)] if plan.echo else None,
        )
        if collectors is not None:  # beam search: the answer is complete; stream it as one delta per beam
            events = _replay(collectors)
        else:
            events = named_events(entry.surge, engine_reqs, plan.logprob_token_ids)
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
            head = writer.role_frames(range(count), first[1][0] if first and first[1] else None)
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
                    metadata=engine_reqs[0].metadata if engine_reqs else None,
                    error=err,
                )

        return SSEResponse(body(), cleanup=cleanup)


def _invocation_kind(data: dict[str, Any]) -> str:
    """/invocations: which route a body belongs to, as vLLM tells them apart (chat has messages; an
    embeddings body has `input`, or `encoding_format` beside its messages)."""
    if "input" in data or "encoding_format" in data:
        return "embedding"
    if "messages" in data:
        return "chat"
    if "prompt" in data:
        return "text_completion"
    raise errors.invalid_request(
        "Cannot tell the request type of this /invocations body: send 'messages' (a chat completion), "
        "'prompt' (a completion) or 'input' (embeddings).",
        param="messages",
    )


async def _replay(collectors: list[Collector]):
    """Finished beams as engine events: (request index, one whole sample per beam)."""
    for i, col in enumerate(collectors):
        samples = []
        for j, c in enumerate(col.choices):
            samples.append(
                ReturnSample(
                    text=c.text,
                    token_ids=c.token_ids,
                    index=j,
                    finish_reason=c.finish_reason,
                    num_generated_tokens=c.generated_tokens,
                    num_prompt_tokens=col.prompt_tokens,
                    prompt_token_ids=col.prompt_token_ids if j == 0 else None,
                )
            )
        yield i, samples
