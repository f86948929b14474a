"""Async plumbing between Starlette and vSurge: merged engine streams, disconnect watching, an SSE response.

Why not Starlette's StreamingResponse: it cancels the body through an anyio cancel scope, which re-cancels
every `await` in the body's `finally`, so closing the engine generator (what frees the slot) could be cut
short. Here a disconnect cancels the producer task once (plain asyncio), and its cleanup runs to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from vsurge.contracts.request import GenerationRequest


class ClientDisconnected(Exception):
    """The client went away before the answer was complete."""


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client closes the connection (the request body must already be consumed)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, coro: Any) -> Any:
    """Await `coro`, cancelling it (and raising ClientDisconnected) if the client leaves first."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        raise ClientDisconnected()
    except asyncio.CancelledError:
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        raise
    finally:
        watch.cancel()


async def engine_events(
    surge: Any, requests: list[GenerationRequest]
) -> AsyncIterator[tuple[int, list[Any]]]:
    """(request index, samples) from one or several engine requests, as they arrive.

    Closing this generator closes every engine generator, which cancels their requests in the driver.
    """
    if len(requests) == 1:
        agen = surge.complete(requests[0])
        try:
            async for samples in agen:
                yield 0, samples
        finally:
            await agen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def pump(i: int, req: GenerationRequest) -> None:
        agen = surge.complete(req)
        try:
            async for samples in agen:
                queue.put_nowait((i, samples))
            queue.put_nowait((i, done_marker))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((i, e))
        finally:
            await agen.aclose()

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse(Response):
    """text/event-stream from an async byte iterator; a client disconnect cancels the producer once.

    `cleanup` runs exactly once when the response is over, however it ended (finished, client gone,
    server error), so the caller's bookkeeping (in-flight count, span, engine stream) never leaks.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        cleanup: Callable[[bool], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body_iterator = body
        self.cleanup = cleanup
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def _pump(self, send: Send) -> None:
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        producer = watcher = None
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            producer = asyncio.ensure_future(self._pump(send))
            watcher = asyncio.ensure_future(wait_disconnect(receive))
            done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if producer in done:
                try:
                    producer.result()
                except OSError:  # ASGI 2.4 servers raise OSError when writing to a closed socket
                    disconnected = True
            else:
                disconnected = True
        except OSError:
            disconnected = True
        finally:
            if watcher is not None:
                watcher.cancel()
            if producer is not None and not producer.done():
                producer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await producer
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self.cleanup is not None:
                await self.cleanup(disconnected)
