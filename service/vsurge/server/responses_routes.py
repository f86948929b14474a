"""The Responses API routes: POST /v1/responses (whole or streamed), GET / DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel. Thin: parse (responses_api.py) -> the chat plan -> run (chat_runs.py) -> shape
(responses_shapes.py) -> store (responses_store.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from . import errors
from .chat_runs import ChatOutcome, outcome_of
from .errors import APIError
from .parsing import GenerationPlan
from .responses_api import PARAM_NAMES, ResponsesPlan, parse_responses
from .responses_shapes import (
    EventWriter,
    as_input_items,
    final_status,
    item_id,
    output_items,
    response_object,
    responses_usage,
)
from .responses_store import StoredResponse
from .served_model import ServedModel
from .streams import ClientDisconnected, SSEResponse
from .wire import dumps


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found"
    )


def _end(record: StoredResponse, status: str, err: APIError | None = None) -> None:
    """A stored response that ended without its output: no longer running, with why."""
    record.cancel = None
    error = {"code": err.code or "server_error", "message": err.message} if err is not None else None
    record.response = {**record.response, "status": status, "error": error}


class ResponsesRoutes:
    """A mixin of vSurgeApiServer (ChatRuns, GenerationRoutes): OpenAI's Responses API over the chat plan."""

    async def responses_create(self, request: Request) -> Response:
        """POST /v1/responses."""
        call = self._call(request, PARAM_NAMES)
        try:
            call.admit()
            data = await self._json(request)
            prev = data.get("previous_response_id")
            history = None
            if isinstance(prev, str):
                stored = self.responses_store.get(prev)
                if stored is None:
                    raise APIError(
                        404,
                        f"Previous response with id '{prev}' not found.",
                        param="previous_response_id",
                        code="previous_response_not_found",
                    )
                if stored.cancel is not None:
                    raise errors.invalid_request(
                        f"Previous response '{prev}' is still in progress.", param="previous_response_id"
                    )
                history = stored.items
            rplan = parse_responses(data, history)
            entry, plan = await self._chat_plan(rplan.chat)
            call.model = entry.name
            rid, created = item_id("resp"), int(time.time())
            call.start_span("chat", entry, plan)
            record = StoredResponse(
                response_object(rid, created, entry.name, rplan.echo, status="in_progress"),
                (history or []) + rplan.input_items,
            )
            if rplan.stream:
                return await self._responses_stream(request, call, entry, plan, rplan, record, rid, created)
            task = asyncio.ensure_future(self._run_chat(request, entry, plan, rid))
            cancelled: list[bool] = []
            record.cancel = lambda: (cancelled.append(True), task.cancel())
            if rplan.store:
                self.responses_store.put(rid, record)
            try:
                outcome, metadata = await task
            except asyncio.CancelledError:
                if not cancelled:
                    raise
                _end(record, "cancelled")
                call.close(200)
                return _json(record.response)
            except BaseException as exc:
                gone = isinstance(exc, ClientDisconnected)  # it stopped with its client, not failed
                _end(record, "incomplete" if gone else "failed", None if gone else errors.from_exception(exc))
                raise
            obj = self._finish_record(record, rplan, entry, rid, created, outcome, item_id("msg"))
            call.close(
                200,
                response_id=rid,
                response_model=entry.name,
                finish_reasons=[outcome.finish_reason or "stop"],
                input_tokens=outcome.prompt_tokens,
                output_tokens=outcome.completion_tokens,
                metadata=metadata,
            )
            return _json(obj)
        except Exception as exc:
            return call.fail(exc)

    def _finish_record(
        self,
        record: StoredResponse,
        rplan: ResponsesPlan,
        entry: ServedModel,
        rid: str,
        created: int,
        outcome: ChatOutcome,
        msg_id: str,
        status: str | None = None,
    ) -> dict[str, Any]:
        """The finished response object; stored with its conversation when the request asked to store."""
        output = output_items(outcome, msg_id)
        usage = responses_usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
        obj = response_object(
            rid,
            created,
            entry.name,
            rplan.echo,
            status=status or final_status(outcome),
            output=output,
            usage=usage,
        )
        record.response, record.cancel = obj, None
        record.items = record.items + as_input_items(output)
        if rplan.store:
            self.responses_store.put(rid, record)
        return obj

    async def _responses_stream(
        self,
        request: Request,
        call: Any,
        entry: ServedModel,
        plan: GenerationPlan,
        rplan: ResponsesPlan,
        record: StoredResponse,
        rid: str,
        created: int,
    ) -> Response:
        deltas, metadata = await self._chat_deltas(request, entry, plan, rid)
        writer = EventWriter()
        msg_id = item_id("msg")
        tool_mode = plan.tools is not None and plan.tools.choice != "none"
        state: dict[str, Any] = {}
        record.cancel = lambda: state.setdefault("cancelled", True)
        if rplan.store:
            self.responses_store.put(rid, record)

        async def body():
            head = record.response
            yield writer.event("response.created", response=head) + writer.event(
                "response.in_progress", response=head
            )
            if not tool_mode:
                yield writer.text_open(msg_id, 0)
            col = None
            try:
                async for delta, latest in deltas:
                    col = latest
                    if state.get("cancelled"):
                        break
                    if delta and not tool_mode:
                        yield writer.text_delta(msg_id, 0, delta)
            except Exception as exc:  # after the 200, an error can only travel in-band
                err = errors.from_exception(exc)
                state["error"] = err
                _end(record, "failed", err)
                yield writer.event("error", code=err.code, message=err.message, param=err.param)
                return
            if col is None:
                outcome = ChatOutcome("", "", None, "stop", 0, 0, 0)
            else:
                outcome = outcome_of(col, plan)
            status = "cancelled" if state.get("cancelled") else None
            obj = self._finish_record(record, rplan, entry, rid, created, outcome, msg_id, status)
            frames = b""
            for i, item in enumerate(obj["output"]):
                if item["type"] == "message":
                    if tool_mode:  # the text was held back to find the calls in it: sent now, whole
                        text = item["content"][0]["text"]
                        frames += writer.text_open(msg_id, i) + writer.text_delta(msg_id, i, text)
                    frames += writer.text_close(item, i)
                else:
                    frames += writer.call(item, i)
            kind = "response.completed" if obj["status"] == "completed" else "response.incomplete"
            state["outcome"] = outcome
            yield frames + writer.event(kind, response=obj)

        async def cleanup(disconnected: bool) -> None:
            await deltas.aclose()  # cancels the engine request if it still runs
            if record.cancel is not None:  # the client left mid-stream: nothing runs any more
                _end(record, "incomplete")
            err = state.get("error")
            outcome = state.get("outcome")
            finish: dict[str, Any] = {"response_id": rid, "response_model": entry.name, "metadata": metadata}
            if outcome is not None:
                finish.update(
                    finish_reasons=[outcome.finish_reason or "stop"],
                    input_tokens=outcome.prompt_tokens,
                    output_tokens=outcome.completion_tokens,
                )
            call.close(499 if disconnected else (err.status if err else 200), err, **finish)

        return SSEResponse(body(), cleanup=cleanup)

    def _stored(self, request: Request, call: Any, span: str, delete: bool) -> tuple[str, Any]:
        """(response id, stored response) of a GET/DELETE/cancel: authorized, found (or removed, with
        ``delete``), its span started; a missing one raises 404."""
        self._check_auth(request)
        rid = request.path_params["response_id"]
        stored = self.responses_store.get(rid)
        if stored is None or (delete and not self.responses_store.delete(rid)):
            raise _not_found(rid)
        call.model = stored.response.get("model", "")
        call.start_span(span, call.model)
        return rid, stored

    async def _stored_route(self, request: Request, span: str, act: Any, *, delete: bool = False) -> Response:
        """One route on /v1/responses/{response_id}, counted under that template (not per id)."""
        call = self._call(request)
        call.label = request.url.path.replace(request.path_params.get("response_id", ""), "{response_id}")
        try:
            answer = act(*self._stored(request, call, span, delete))
            call.close(200)
            return _json(answer)
        except Exception as exc:
            return call.fail(exc)

    async def responses_get(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}: a stored response (in progress or finished)."""
        return await self._stored_route(request, "responses.retrieve", lambda rid, stored: stored.response)

    async def responses_delete(self, request: Request) -> Response:
        """DELETE /v1/responses/{response_id}."""

        def delete(rid: str, stored: Any) -> dict:
            if stored.cancel is not None:
                stored.cancel()
            return {"id": rid, "object": "response.deleted", "deleted": True}

        return await self._stored_route(request, "responses.delete", delete, delete=True)

    async def responses_cancel(self, request: Request) -> Response:
        """POST /v1/responses/{response_id}/cancel: stops a response that is still running."""

        def cancel(rid: str, stored: Any) -> dict:
            if stored.cancel is None:
                raise errors.invalid_request(
                    f"Cannot cancel response '{rid}': its status is {stored.response.get('status')!r}.",
                    param="response_id",
                )
            stored.cancel()
            stored.cancel = None
            stored.response = {**stored.response, "status": "cancelled"}
            return stored.response

        return await self._stored_route(request, "responses.cancel", cancel)
