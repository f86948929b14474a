"""Forwarding one request to a pod, and streaming its answer back unbuffered.

The picker (policies.py) chooses the pod for each attempt. An attempt that did not reach the model is
retried on another pod, once by default (`--max-attempts 2`): the connection was refused or timed out,
it dropped before the first byte of the answer, or the pod answered 503 (starting or draining, with
Retry-After) or 429 (its queue is full). Nothing has reached the client then: the router holds the
response until the upstream's first body bytes arrived (a non-streamed answer is one piece; a stream's
first event comes with the first token), and the request body is buffered, so the retry sends the same
bytes. A generation has no side effects, so a retry after a half-done generation is safe. Once a byte
was relayed nothing is retried. A refused or dropped pod, and one answering 503, is ejected for a few
seconds; a 429 is not (the pod is busy, not gone).

The answer is relayed chunk by chunk as it arrives (`aiter_raw`, no re-encoding), so server-sent events
pass through as they are produced. End-to-end headers (`Authorization` unless the router checks API keys
itself, `traceparent`, `tracestate`, `baggage`, ...) go through; hop-by-hop ones (RFC 9110 section 7.6.1)
do not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .metrics import RouterMetrics
from .policies import Decision, Picker
from .usage import UsageScanner

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# The client decides these for the upstream leg: Host from the URL, Content-Length from the body.
_REQUEST_ONLY = frozenset({"host", "content-length"})
# httpx adds these to every request; a transparent proxy sends them only if its client did. Above all
# Accept-Encoding: the body is relayed undecoded, so the upstream must not compress for a client that
# never asked for it.
_CLIENT_DEFAULTS = ("accept", "accept-encoding", "user-agent")
# The router's server sets its own Date (and no Server); the upstream's would be duplicates.
_RESPONSE_OWN = frozenset({"date", "server"})

# Failures that mean "this upstream did not take the request": try another one.
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
DROPPED_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    # Headers named in `Connection:` are hop-by-hop too.
    return {
        token.strip().lower()
        for k, v in headers
        if k.lower() == "connection"
        for token in v.split(",")
        if token.strip()
    }


def request_headers(
    headers: Sequence[tuple[str, str]], client_host: str | None = None
) -> list[tuple[str, str]]:
    """Headers for the upstream request: end-to-end ones kept in order, X-Forwarded-For extended."""
    drop = HOP_BY_HOP | _REQUEST_ONLY | _connection_tokens(headers)
    out = [(k, v) for k, v in headers if k.lower() not in drop and k.lower() != "x-forwarded-for"]
    if client_host:
        forwarded = [v for k, v in headers if k.lower() == "x-forwarded-for"]
        out.append(("x-forwarded-for", ", ".join([*forwarded, client_host])))
    return out


def response_headers(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Upstream response headers minus hop-by-hop ones and Date/Server; Content-Length stays (the bytes are
    relayed as they came)."""
    text = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
    drop = HOP_BY_HOP | _RESPONSE_OWN | _connection_tokens(text)
    return [(k.lower(), v) for k, v in raw if k.decode("latin-1").lower() not in drop]


async def _relay(
    first: bytes, rest: AsyncIterator[bytes], scanner: UsageScanner | None
) -> AsyncIterator[bytes]:
    if scanner is None:
        if first:
            yield first
        async for chunk in rest:
            yield chunk
        return
    out = scanner.feed(first) if first else b""
    if out:
        yield out
    async for chunk in rest:
        out = scanner.feed(chunk)
        if out:
            yield out
    out = scanner.finish()
    if out:
        yield out


class ProxiedResponse(StreamingResponse):
    """Relays an open upstream response; closes it (and runs `on_close`) however the relay ends.

    `first` is the body's first chunk, already read (see the module docstring); `scanner` watches the
    bytes for token usage. Starlette's StreamingResponse stops relaying when the client disconnects;
    closing the upstream response then drops that connection, which the vSurge server sees as a
    disconnect and frees the slot.
    """

    def __init__(
        self,
        upstream: httpx.Response,
        upstream_url: str,
        on_close: Callable[[], None],
        *,
        first: bytes = b"",
        rest: AsyncIterator[bytes] | None = None,
        scanner: UsageScanner | None = None,
    ) -> None:
        body = _relay(first, rest if rest is not None else upstream.aiter_raw(), scanner)
        super().__init__(body, status_code=upstream.status_code)
        self.raw_headers = response_headers(upstream.headers.raw)
        if scanner is not None and scanner.strip:
            # Taking the usage frame out changes the length; a stream has none, but be sure.
            self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.upstream = upstream
        self.upstream_url = upstream_url
        self.scanner = scanner
        self.attempts: list[Attempt] = []
        self.decision: Decision | None = None
        self._on_close: list[Callable[[], None]] = [on_close]
        self._closed = False

    def add_close_callback(self, fn: Callable[[], None]) -> None:
        self._on_close.append(fn)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.discard()

    async def discard(self) -> None:
        """Close the upstream response without relaying (also for a response never sent)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.upstream.aclose()
        finally:
            for fn in self._on_close:
                try:
                    fn()
                except Exception:  # a metrics callback must not hide the real outcome
                    log.exception("close callback failed")


class NoUpstreamAvailable(Exception):
    """Every upstream tried failed before answering."""

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class Attempt:
    """One try of a request: the pod, and what ended it (`ok`, or why the next one was made)."""

    upstream: str
    outcome: str  # ok, connect_error, dropped, unavailable (503), busy (429)


RETRY_STATUSES = {503: "unavailable", 429: "busy"}


class Forwarder:
    def __init__(
        self,
        client: httpx.AsyncClient,
        picker: Picker,
        metrics: RouterMetrics,
        max_attempts: int = 2,
    ) -> None:
        self.client = client
        self.picker = picker
        self.tracker = picker.tracker
        self.metrics = metrics
        self.max_attempts = max(1, max_attempts)

    def _build(self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes) -> httpx.Request:
        request = self.client.build_request(method, url, headers=list(headers), content=body)
        sent = {k.lower() for k, _ in headers}
        for name in _CLIENT_DEFAULTS:
            if name not in sent:
                request.headers.pop(name, None)
        return request

    async def forward(
        self,
        model: str,
        upstreams: Sequence[str],
        method: str,
        path: str,
        query: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        *,
        hashes: Sequence[bytes] = (),
        scanner: UsageScanner | None = None,
        base: str | None = None,
    ) -> ProxiedResponse:
        """Send to the pod the picker chooses, retrying elsewhere; the response is open (stream it).
        `base`: `model` is a LoRA adapter of that model (its pods serve it)."""
        tried: list[str] = []
        attempts: list[Attempt] = []
        for attempt in range(self.max_attempts):
            decision = self.picker.pick(model, upstreams, hashes, exclude=tried, base=base)
            if decision is None:
                break
            upstream = decision.upstream
            tried.append(upstream)
            self.metrics.picks.labels(model, decision.policy, decision.how).inc()
            if decision.adapter is not None:
                self.metrics.adapter_picks.labels(model, decision.adapter).inc()
            url = f"{upstream}{path}" + (f"?{query}" if query else "")
            self.tracker.acquire(upstream)
            started = time.perf_counter()
            last = attempt + 1 == self.max_attempts or len(tried) >= len(set(upstreams))
            try:
                response = await self.client.send(self._build(method, url, headers, body), stream=True)
            except (*CONNECT_ERRORS, *DROPPED_ERRORS) as e:
                outcome = "connect_error" if isinstance(e, CONNECT_ERRORS) else "dropped"
                self._failed(model, upstream, outcome, e, retry=not last)
                attempts.append(Attempt(upstream, outcome))
                continue
            except BaseException:  # cancelled (the client left) or a bug: the slot count must stay right
                self.tracker.release(upstream)
                raise
            self.metrics.upstream_latency.labels(model).observe(time.perf_counter() - started)
            status = response.status_code
            reason = RETRY_STATUSES.get(status)
            if reason is not None and not last:
                await response.aclose()
                self.tracker.release(upstream)
                if status == 503:
                    self.tracker.eject(upstream)
                self.metrics.upstream_requests.labels(model, upstream, str(status)).inc()
                self.metrics.retries.labels(model, reason).inc()
                attempts.append(Attempt(upstream, reason))
                continue
            rest = response.aiter_raw()
            try:
                first = await _first_chunk(rest)
            except DROPPED_ERRORS as e:
                await response.aclose()
                self._failed(model, upstream, "dropped", e, retry=not last)
                attempts.append(Attempt(upstream, "dropped"))
                continue
            except BaseException:
                await response.aclose()
                self.tracker.release(upstream)
                raise
            self.metrics.upstream_requests.labels(model, upstream, str(status)).inc()
            if status != 503:
                self.tracker.reinstate(upstream)
            attempts.append(Attempt(upstream, "ok"))
            proxied = ProxiedResponse(
                response,
                upstream,
                on_close=lambda u=upstream: self.tracker.release(u),
                first=first,
                rest=rest,
                scanner=scanner,
            )
            proxied.attempts = attempts
            proxied.decision = decision
            return proxied
        failures = "; ".join(f"{a.upstream}: {a.outcome}" for a in attempts)
        raise NoUpstreamAvailable(failures or "no upstream", attempts)

    def _failed(self, model: str, upstream: str, outcome: str, error: BaseException, *, retry: bool) -> None:
        self.tracker.release(upstream)
        self.tracker.eject(upstream)
        self.metrics.upstream_requests.labels(model, upstream, outcome).inc()
        log.warning(
            "model %s: upstream %s failed (%s: %s); ejected", model, upstream, type(error).__name__, error
        )
        if retry:
            self.metrics.retries.labels(model, outcome).inc()


async def _first_chunk(chunks: AsyncIterator[bytes]) -> bytes:
    """The body's first non-empty chunk (b"" for an empty body); the iterator stays open for the rest."""
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return b""
        if chunk:
            return chunk
