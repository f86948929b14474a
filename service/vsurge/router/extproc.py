"""The router as the Gateway API Inference Extension's endpoint picker: an Envoy ext_proc gRPC server.

`vsurge route --ext-proc-port 9002` serves, beside its HTTP API, the endpoint-picker protocol
(epp_protocol.py) for the InferencePools the operator renders: the Gateway's proxy sends each request's
headers and body over an ext_proc stream; the picker answers where it goes, with fallbacks, and the proxy
sends it there itself (the router does not relay the bytes).

The decision is the router's own (policies.py): the model from the body's `model` (or the
`x-gateway-model-name` header when the proxy sends no body), its pods from the EndpointSlices (or the
proxy's subset hint, which restricts them), the policy of the model (`prefix` for paged-driver pods:
prefix-cache affinity with bounded load; else least-load on the pods' `/load`: queue, decode slots and KV
use), LoRA affinity for an adapter's requests (pods that have it loaded). The tenants' gate holds as on
the HTTP path: a missing or unknown key is 401, another tenant's model 404, over a limit 429 (tokens are
charged from the answer's usage when the proxy streams the response body through), and the tenant's key
is replaced by the model's own key towards the pod (or removed). In-flight counts follow each stream, so
the router's HTTP path and the gateway path see each other's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from . import epp_protocol as epp
from . import errors
from .admission import Gate
from .metrics import RouterMetrics
from .policies import Picker
from .prefix import request_hashes
from .table import EndpointTable
from .tenants import Tenant
from .upstream_keys import UpstreamKeys
from .usage import UsageScanner
from .wake import Waker

log = logging.getLogger(__name__)

MODEL_HEADER = "x-gateway-model-name"


@dataclass
class Choice:
    """Where a request goes: endpoints (primary first), the headers to set and to remove."""

    model: str
    endpoints: list[str]
    set_headers: dict[str, str] = field(default_factory=dict)
    remove_headers: list[str] = field(default_factory=list)
    tenant: Tenant | None = None


@dataclass
class _Stream:
    mode: str = "streamed"
    response_streamed: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    hint: list[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    choice: Choice | None = None
    acquired: str | None = None
    scanner: UsageScanner | None = None


def _refusal(response: Any) -> ext_proc.ProcessingResponse:
    """A Starlette answer of the gate or errors.py as the proxy's immediate response."""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length",)}
    return epp.immediate(response.status_code, bytes(response.body), headers)


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):
    """One ext_proc stream per HTTP request; see the module docstring."""

    def __init__(
        self,
        table: EndpointTable,
        picker: Picker,
        gate: Gate,
        metrics: RouterMetrics,
        keys: UpstreamKeys | None = None,
        waker: Waker | None = None,
        *,
        fallbacks: int = 2,
        max_body_bytes: int = 8 * 1024 * 1024,
        prefix_block_bytes: int = 256,
        retry_after_seconds: float = 5.0,
    ) -> None:
        self.table = table
        self.picker = picker
        self.gate = gate
        self.metrics = metrics
        self.keys = keys
        self.waker = waker
        self._waking: dict[str, asyncio.Task[Any]] = {}
        self.fallbacks = fallbacks
        self.max_body_bytes = max_body_bytes
        self.prefix_block_bytes = prefix_block_bytes
        self.retry_after_seconds = retry_after_seconds

    # -- the decision (no I/O)

    def decide(
        self, headers: Mapping[str, str], body: bytes, hint: list[str] | None
    ) -> Choice | ext_proc.ProcessingResponse:
        tenant = self.gate.authenticate(headers)
        if not isinstance(tenant, Tenant | None):
            return _refusal(tenant)
        payload: dict[str, Any] = {}
        if body:
            try:
                parsed = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                parsed = None
            if isinstance(parsed, dict):
                payload = parsed
        model = payload.get("model") or headers.get(MODEL_HEADER) or ""
        if not isinstance(model, str):
            model = ""
        view = self.table.lookup(model) if model else None
        if model and not self.gate.may_use(tenant, model):
            return _refusal(self.gate.not_found(model))
        if view is None and (hint is None or self.gate.enabled):
            # without the proxy's list the pool's pods are the model's; a tenant names a model it may use
            if not model:
                return _refusal(errors.bad_request("You must provide a model parameter.", param="model"))
            return _refusal(self.gate.not_found(model))
        refused = self.gate.admit(tenant)
        if refused is not None:
            return _refusal(refused)
        if hint is not None:
            candidates = [epp.upstream_of(e) for e in hint]
        else:
            candidates = list(view.upstreams) if view is not None else []
        if not candidates:
            if hint is None and view is not None:
                self._wake(model)
            return _refusal(
                errors.unavailable(
                    f"No replica of the model `{model}` is ready; try again later.",
                    "no_upstreams",
                    self.retry_after_seconds,
                )
            )
        base = view.base if view is not None else None
        hashes: list[bytes] = []
        if model and self.picker.policy_for(base or model, candidates) == "prefix":
            path = headers.get(":path", "/v1/chat/completions").split("?", 1)[0]
            hashes = request_hashes(path, payload, model, self.prefix_block_bytes)
        first = self.picker.pick(model, candidates, hashes, base=base)
        if first is None:
            return _refusal(
                errors.unavailable("No endpoint is eligible.", "no_upstreams", self.retry_after_seconds)
            )
        self.metrics.picks.labels(model if view is not None else "", first.policy, first.how).inc()
        chosen = [first.upstream]
        while len(chosen) <= self.fallbacks:
            more = self.picker.pick(model, candidates, (), exclude=chosen, base=base)
            if more is None or more.upstream in chosen:
                break
            chosen.append(more.upstream)
        choice = Choice(model, [epp.endpoint_of(u) for u in chosen], tenant=tenant)
        key = self.keys.authorization(view) if self.keys is not None and view is not None else None
        if key is not None:
            choice.set_headers["authorization"] = key
        elif self.gate.enabled:  # the tenant's key is the router's business, not the pod's
            choice.remove_headers.append("authorization")
        return choice

    def _wake(self, model: str) -> None:
        """A model with no ready pod: wake it (the scale subresource, wake.py) in the background; this
        request is answered 503 with Retry-After, the client's retry finds a pod. One wake per model."""
        if self.waker is None or model in self._waking:
            return
        task = asyncio.ensure_future(self.waker.upstreams_for(model))
        self._waking[model] = task

        def done(t: asyncio.Task[Any]) -> None:
            self._waking.pop(model, None)
            if not t.cancelled() and t.exception() is not None:
                log.info("ext_proc: waking %s: %s", model, t.exception())

        task.add_done_callback(done)

    # -- the stream

    async def Process(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: Any
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        s = _Stream()
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if s.hint is None:
                    s.hint = epp.subset_hint(req)
                if kind == "request_headers":
                    s.mode = epp.body_mode(req)
                    s.response_streamed = epp.response_streamed(req)
                    s.headers = epp.headers_of(req.request_headers)
                    if req.request_headers.end_of_stream or s.mode == "none":
                        answer = self._answer(s, on_body=False)
                        yield answer
                        if answer.HasField("immediate_response"):
                            return
                    elif s.mode == "buffered":
                        yield epp.headers_continue()
                elif kind == "request_body":
                    s.body += req.request_body.body
                    if len(s.body) > self.max_body_bytes:
                        yield _refusal(
                            errors.error_response(
                                413,
                                f"The request body is larger than {self.max_body_bytes} bytes.",
                                code="request_too_large",
                            )
                        )
                        return
                    if not req.request_body.end_of_stream:
                        if s.mode == "buffered":  # BUFFERED_PARTIAL hands over pieces: take them all
                            yield epp.body_continue()
                        continue
                    answer = self._answer(s, on_body=s.mode == "buffered")
                    yield answer
                    if answer.HasField("immediate_response"):
                        return
                    if s.mode == "streamed":
                        yield epp.body_chunk(bytes(s.body), True)
                elif kind == "request_trailers":
                    yield ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
                elif kind == "response_headers":
                    yield epp.headers_continue(response=True)
                elif kind == "response_body":
                    chunk = req.response_body.body
                    if s.scanner is not None:
                        s.scanner.feed(chunk)
                    if s.response_streamed:
                        yield epp.body_chunk(chunk, req.response_body.end_of_stream, response=True)
                    else:
                        yield epp.body_continue(response=True)
                elif kind == "response_trailers":
                    yield ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
        finally:
            self._finish(s)

    def _answer(self, s: _Stream, *, on_body: bool) -> ext_proc.ProcessingResponse:
        outcome = self.decide(s.headers, bytes(s.body), s.hint)
        if not isinstance(outcome, Choice):
            status = outcome.immediate_response.status.code
            self.metrics.requests.labels("", str(status)).inc()
            return outcome
        s.choice = outcome
        s.acquired = epp.upstream_of(outcome.endpoints[0])
        self.picker.tracker.acquire(s.acquired)
        if outcome.tenant is not None:  # tokens are charged from the answer's usage, as on the HTTP path
            try:
                stream = json.loads(bytes(s.body)).get("stream") is True
            except (ValueError, UnicodeDecodeError, AttributeError):
                stream = False
            s.scanner = UsageScanner(stream=stream)
        log.debug("ext_proc: %s -> %s", outcome.model, ",".join(outcome.endpoints))
        return epp.picked(
            outcome.endpoints,
            set_headers=outcome.set_headers,
            remove_headers=outcome.remove_headers,
            on_body=on_body,
        )

    def _finish(self, s: _Stream) -> None:
        if s.acquired is not None:
            self.picker.tracker.release(s.acquired)
        c = s.choice
        if c is None:
            return
        self.metrics.requests.labels(c.model if self.table.lookup(c.model) else "", "200").inc()
        if c.tenant is not None:
            self.metrics.tenant_requests.labels(c.tenant.name, c.model, "200").inc()
            if s.scanner is not None:
                s.scanner.finish()
            usage = s.scanner.usage if s.scanner is not None else None
            self.gate.charge(c.tenant, c.model, usage)


class ExtProcServer:
    """The gRPC server, started and stopped with the app like a discovery source."""

    def __init__(self, servicer: EndpointPicker, host: str, port: int) -> None:
        self.servicer = servicer
        self.host = host
        self.port = port
        self.bound_port: int | None = None
        self._server: Any = None

    async def start(self, table: EndpointTable) -> None:
        import grpc

        self._server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.servicer, self._server)
        host = "[::]" if self.host in ("0.0.0.0", "::") else self.host
        self.bound_port = self._server.add_insecure_port(f"{host}:{self.port}")
        await self._server.start()
        log.info("endpoint picker (ext_proc) listening on %s:%d", self.host, self.bound_port)

    async def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.stop(grace=5)
