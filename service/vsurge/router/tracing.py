"""OpenTelemetry spans of the router: one SERVER span per proxied request, continued by the pod's span.

The span follows the OTel GenAI semantic conventions where they apply (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.request.max_tokens` ..., `gen_ai.usage.*` when the answer carried usage)
and says what the router did: `server.address`/`server.port` and `vsurge.router.upstream` (the pod that
answered), `vsurge.router.policy` and `vsurge.router.pick` (how it was chosen), `vsurge.router.retries`
and `vsurge.router.attempts` (each pod tried and why it was left), `vsurge.tenant`. It starts when the
request arrives (a client's `traceparent` makes it a child) and ends with the last byte of the answer.
The request goes upstream with this span's `traceparent`, so the engine's span is its child: router and
engine spans form one trace.

Off unless the OTEL_* environment asks for export, as for `vsurge serve` (same variables; service name
`vsurge-router` unless OTEL_SERVICE_NAME says otherwise): every method is then a no-op. The server's
module is not imported: the server package pulls in the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

_TRUE = {"1", "true", "yes", "on"}
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
_REQUEST_ATTRS = (
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("seed", "gen_ai.request.seed"),
)
_PROPAGATED = ("traceparent", "tracestate", "baggage")


def tracing_configured(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def provider_from_env(env: Mapping[str, str] | None = None) -> Any:
    """A TracerProvider exporting as the OTEL_* variables say (OTLP or console), or None."""
    env = os.environ if env is None else env
    if not tracing_configured(env):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": "vsurge-router"}
    provider = TracerProvider(resource=Resource.create(attrs))
    for name in [n.strip() for n in (env.get("OTEL_TRACES_EXPORTER") or "otlp").lower().split(",")]:
        if name == "otlp":
            protocol = (
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc"
            ).lower()
            if protocol.startswith("http"):
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
                    OTLPSpanExporter,
                )
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name and name != "none":
            raise RuntimeError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}; use otlp, console or none")
    return provider


class RouterTracing:
    """Starts, propagates and ends request spans; every method is a no-op when `enabled` is False."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self.provider = tracer_provider
        self.tracer = None
        if tracer_provider is not None:
            from vsurge.version import __version__

            self.tracer = tracer_provider.get_tracer("vsurge.router", __version__)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RouterTracing:
        return cls(provider_from_env(env))

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def start(self, path: str, model: str, headers: Mapping[str, str], payload: Mapping[str, Any]) -> Any:
        """The request's span, a child of the caller's `traceparent` when it sent one."""
        if self.tracer is None:
            return None
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        operation = OPERATIONS.get(path)
        attrs: dict[str, Any] = {
            "gen_ai.provider.name": "vsurge",
            "gen_ai.system": "vsurge",
            "gen_ai.request.model": model,
            "http.request.method": "POST",
            "http.route": path,
        }
        if operation:
            attrs["gen_ai.operation.name"] = operation
        for field, attr in _REQUEST_ATTRS:
            value = payload.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attrs[attr] = value
        name = f"{operation} {model}" if operation else f"POST {path}"
        return self.tracer.start_span(
            name,
            context=propagate.extract(headers),
            kind=SpanKind.SERVER,
            attributes=attrs,
            start_time=time.time_ns(),
        )

    def outgoing_headers(self, span: Any, headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """`headers` with the trace context of `span` in place of the caller's."""
        if span is None:
            return list(headers)
        from opentelemetry import propagate, trace

        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        kept = [(k, v) for k, v in headers if k.lower() not in _PROPAGATED]
        return kept + [(k, v) for k, v in carrier.items()]

    def set_tenant(self, span: Any, tenant: str | None) -> None:
        if span is not None and tenant:
            span.set_attribute("vsurge.tenant", tenant)

    def finish(
        self,
        span: Any,
        status: int,
        *,
        upstream: str | None = None,
        policy: str | None = None,
        pick: str | None = None,
        attempts: Sequence[tuple[str, str]] = (),
        usage: tuple[int, int] | None = None,
        error: str | None = None,
    ) -> None:
        """Record the outcome and end the span (at the answer's last byte)."""
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("http.response.status_code", status)
        if upstream:
            span.set_attribute("vsurge.router.upstream", upstream)
            parts = urlsplit(upstream)
            if parts.hostname:
                span.set_attribute("server.address", parts.hostname)
            if parts.port:
                span.set_attribute("server.port", parts.port)
        if policy:
            span.set_attribute("vsurge.router.policy", policy)
        if pick:
            span.set_attribute("vsurge.router.pick", pick)
        span.set_attribute("vsurge.router.retries", max(0, len(attempts) - 1) if attempts else 0)
        if attempts:
            span.set_attribute("vsurge.router.attempts", [f"{u} {o}" for u, o in attempts])
        if usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage[0])
            span.set_attribute("gen_ai.usage.output_tokens", usage[1])
        if error or status >= 500:
            span.set_attribute("error.type", error or str(status))
            span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        span.end()

    def shutdown(self) -> None:
        if self.provider is not None and hasattr(self.provider, "shutdown"):
            self.provider.shutdown()
