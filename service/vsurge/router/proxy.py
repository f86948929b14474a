"""Forwarding one request to an upstream, and streaming its answer back unbuffered.

The request goes to the upstream with the fewest requests in flight. If that upstream cannot be reached
(connection refused, connect timeout, the connection dropped before any response) it is ejected for a
few seconds and the request goes to the next one: nothing has been sent to the client yet, and a
generation has no side effects, so a retry is safe. An upstream answering 503 (starting or draining, it
says so with Retry-After) is skipped the same way while another one is left. Once response headers
arrived, the answer is the client's: the body is relayed chunk by chunk as it arrives (`aiter_raw`, no
re-encoding), so server-sent events pass through as they are produced. End-to-end headers
(`Authorization`, `traceparent`, `tracestate`, `baggage`, ...) go through untouched; hop-by-hop ones
(RFC 9110 section 7.6.1) do not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .metrics import RouterMetrics
from .picking import LoadTracker

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


class ProxiedResponse(StreamingResponse):
    """Relays an open upstream response; closes it (and runs `on_close`) however the relay ends.

    Starlette's StreamingResponse stops relaying when the client disconnects; closing the upstream
    response then drops that connection, which the vSurge server sees as a disconnect and frees the slot.
    """

    def __init__(self, upstream: httpx.Response, upstream_url: str, on_close: Callable[[], None]) -> None:
        super().__init__(upstream.aiter_raw(), status_code=upstream.status_code)
        self.raw_headers = response_headers(upstream.headers.raw)
        self.upstream = upstream
        self.upstream_url = upstream_url
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


class Forwarder:
    def __init__(
        self, client: httpx.AsyncClient, tracker: LoadTracker, metrics: RouterMetrics, max_attempts: int = 3
    ) -> None:
        self.client = client
        self.tracker = tracker
        self.metrics = metrics
        self.max_attempts = max(1, max_attempts)

    async def forward(
        self,
        model: str,
        upstreams: Sequence[str],
        method: str,
        path: str,
        query: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
    ) -> ProxiedResponse:
        """Send to the least-loaded upstream, retrying elsewhere; the response is open (stream it)."""
        tried: list[str] = []
        failures: list[str] = []
        for attempt in range(self.max_attempts):
            upstream = self.tracker.pick(upstreams, exclude=tried)
            if upstream is None:
                break
            tried.append(upstream)
            url = f"{upstream}{path}" + (f"?{query}" if query else "")
            self.tracker.acquire(upstream)
            started = time.perf_counter()
            try:
                request = self.client.build_request(method, url, headers=list(headers), content=body)
                sent = {k.lower() for k, _ in headers}
                for name in _CLIENT_DEFAULTS:
                    if name not in sent:
                        request.headers.pop(name, None)
                response = await self.client.send(request, stream=True)
            except (*CONNECT_ERRORS, *DROPPED_ERRORS) as e:
                self.tracker.release(upstream)
                self.tracker.eject(upstream)
                outcome = "connect_error" if isinstance(e, CONNECT_ERRORS) else "dropped"
                self.metrics.upstream_requests.labels(model, upstream, outcome).inc()
                failures.append(f"{upstream}: {type(e).__name__}")
                log.warning(
                    "model %s: upstream %s failed (%s: %s); ejected", model, upstream, type(e).__name__, e
                )
                if attempt + 1 < self.max_attempts and len(tried) < len(upstreams):
                    self.metrics.retries.labels(model, outcome).inc()
                continue
            except BaseException:  # cancelled (the client left) or a bug: the slot count must stay right
                self.tracker.release(upstream)
                raise
            self.metrics.upstream_latency.labels(model).observe(time.perf_counter() - started)
            self.metrics.upstream_requests.labels(model, upstream, str(response.status_code)).inc()
            if (
                response.status_code == 503
                and attempt + 1 < self.max_attempts
                and len(tried) < len(upstreams)
            ):
                await response.aclose()
                self.tracker.release(upstream)
                self.tracker.eject(upstream)
                self.metrics.retries.labels(model, "unavailable").inc()
                failures.append(f"{upstream}: 503")
                continue
            if response.status_code != 503:
                self.tracker.reinstate(upstream)
            return ProxiedResponse(response, upstream, on_close=lambda u=upstream: self.tracker.release(u))
        raise NoUpstreamAvailable("; ".join(failures) or "no upstream")
