"""Anthropic's Messages API routes: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens.
Thin: translate (anthropic_messages.py) -> the chat plan -> run (chat_runs.py) -> shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from . import errors
from .anthropic_messages import (
    PARAM_NAMES,
    anthropic_usage,
    content_blocks,
    error_body,
    event,
    message_object,
    messages_to_chat,
    new_message_id,
    stop_details,
)
from .chat_runs import ChatOutcome, outcome_of
from .errors import APIError
from .parsing import GenerationPlan
from .served_model import ServedModel, _decode
from .streams import SSEResponse
from .wire import dumps


def _error(err: APIError) -> Response:
    return Response(
        error_body(err), status_code=err.status, media_type="application/json", headers=err.headers
    )


def _stop(entry: ServedModel, plan: GenerationPlan, outcome: ChatOutcome) -> tuple[str, str | None]:
    stops = list(plan.sampling.stop or [])
    full = _decode(entry, outcome.token_ids) if stops and outcome.finish_reason == "stop" else outcome.text
    return stop_details(outcome, stops, full)


class MessagesRoutes:
    """A mixin of vSurgeApiServer (ChatRuns, GenerationRoutes): Anthropic's Messages API."""

    async def messages_create(self, request: Request) -> Response:
        """POST /v1/messages."""
        call = self._call(request, PARAM_NAMES)
        try:
            call.admit()
            data = await self._json(request)
            entry, plan = await self._chat_plan(messages_to_chat(data))
            call.model = entry.name
            call.start_span("chat", entry, plan)
            msg_id = new_message_id()
            if plan.stream:
                return await self._messages_stream(request, call, entry, plan, msg_id)
            outcome, metadata = await self._run_chat(request, entry, plan, msg_id)
            stop = _stop(entry, plan, outcome)
            obj = message_object(msg_id, entry.name, content_blocks(outcome), stop, anthropic_usage(outcome))
            call.close(
                200,
                response_id=msg_id,
                response_model=entry.name,
                finish_reasons=[stop[0]],
                input_tokens=outcome.prompt_tokens,
                output_tokens=outcome.completion_tokens,
                metadata=metadata,
            )
            return Response(dumps(obj), media_type="application/json")
        except Exception as exc:
            return call.fail(exc, _error)

    async def _messages_stream(
        self, request: Request, call: Any, entry: ServedModel, plan: GenerationPlan, msg_id: str
    ) -> Response:
        deltas, metadata = await self._chat_deltas(request, entry, plan, msg_id)
        tool_mode = plan.tools is not None and plan.tools.choice != "none"
        state: dict[str, Any] = {}

        async def body():
            col = None
            started = False
            try:
                async for delta, latest in deltas:
                    col = latest
                    if not started:  # the prompt's size is known with the first delta
                        started = True
                        usage = {**anthropic_usage(outcome_of(col, plan)), "output_tokens": 0}
                        head = message_object(msg_id, entry.name, [], (None, None), usage)
                        yield event("message_start", message=head)
                        if not tool_mode:
                            yield event(
                                "content_block_start", index=0, content_block={"type": "text", "text": ""}
                            )
                    if delta and not tool_mode:
                        yield event(
                            "content_block_delta", index=0, delta={"type": "text_delta", "text": delta}
                        )
            except Exception as exc:  # after the 200, an error can only travel in-band
                err = errors.from_exception(exc)
                state["error"] = err
                yield b"event: error\ndata: " + error_body(err) + b"\n\n"
                return
            outcome = outcome_of(col, plan) if col is not None else ChatOutcome("", "", None, "stop", 0, 0, 0)
            state["outcome"] = outcome
            out = b""
            if not started:
                usage = {**anthropic_usage(outcome), "output_tokens": 0}
                out += event(
                    "message_start", message=message_object(msg_id, entry.name, [], (None, None), usage)
                )
            if tool_mode:
                for i, block in enumerate(content_blocks(outcome)):
                    if block["type"] == "text":
                        out += event(
                            "content_block_start", index=i, content_block={"type": "text", "text": ""}
                        )
                        out += event(
                            "content_block_delta",
                            index=i,
                            delta={"type": "text_delta", "text": block["text"]},
                        )
                    else:
                        out += event("content_block_start", index=i, content_block={**block, "input": {}})
                        args = json.dumps(block["input"], ensure_ascii=False)
                        out += event(
                            "content_block_delta",
                            index=i,
                            delta={"type": "input_json_delta", "partial_json": args},
                        )
                    out += event("content_block_stop", index=i)
            else:
                if not started:
                    out += event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                out += event("content_block_stop", index=0)
            stop = _stop(entry, plan, outcome)
            state["stop"] = stop[0]
            out += event(
                "message_delta",
                delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                usage=anthropic_usage(outcome),  # the whole usage, as Anthropic's own streams end
            )
            yield out + event("message_stop")

        async def cleanup(disconnected: bool) -> None:
            await deltas.aclose()
            err, outcome = state.get("error"), state.get("outcome")
            finish: dict[str, Any] = {
                "response_id": msg_id,
                "response_model": entry.name,
                "metadata": metadata,
            }
            if outcome is not None:
                finish.update(
                    finish_reasons=[state.get("stop") or "end_turn"],
                    input_tokens=outcome.prompt_tokens,
                    output_tokens=outcome.completion_tokens,
                )
            call.close(499 if disconnected else (err.status if err else 200), err, **finish)

        return SSEResponse(body(), cleanup=cleanup)

    async def messages_count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would feed the engine."""
        call = self._call(request, PARAM_NAMES)
        try:
            self._check_auth(request)
            data = await self._json(request)
            entry, plan = await self._chat_plan(messages_to_chat(data, count_only=True))
            call.model = entry.name
            call.start_span("count_tokens", entry)
            prompt = plan.prompts[0]
            ids = (
                prompt if isinstance(prompt, list) else await asyncio.to_thread(entry.surge.tokenize, prompt)
            )
            call.close(200)
            return Response(dumps({"input_tokens": len(ids)}), media_type="application/json")
        except Exception as exc:
            return call.fail(exc, _error)
