"""OpenTelemetry tracing: one SERVER span per generation request, with GenAI semantic-convention attributes.

Unconfigured (no `OTEL_TRACES_EXPORTER` and no OTLP endpoint in the environment) there is no tracer at
all: routes check `tracing.enabled` and skip every span call, so tracing costs nothing. Configured, the
SDK reads the standard variables itself (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER`, `OTEL_EXPORTER_OTLP_*`, `OTEL_BSP_*`). An incoming W3C `traceparent` header is
continued through the global propagator (`OTEL_PROPAGATORS`, default tracecontext + baggage).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}


def tracing_configured(env: Mapping[str, str]) -> bool:
    """True when the environment asks for spans to be exported somewhere."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _otlp_exporter(env: Mapping[str, str]) -> Any:
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).lower()
    if protocol.startswith("http"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise RuntimeError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol} needs opentelemetry-exporter-otlp-proto-http; "
                "install it or use grpc"
            ) from e
        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def provider_from_env(env: Mapping[str, str] | None = None, service_name: str = "vsurge") -> Any:
    """A TracerProvider exporting as the OTEL_* variables say, or None when tracing is not configured."""
    env = os.environ if env is None else env
    if not tracing_configured(env):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attrs))
    names = [n.strip() for n in (env.get("OTEL_TRACES_EXPORTER") or "otlp").lower().split(",") if n.strip()]
    for name in names:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(env)))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name != "none":
            raise RuntimeError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}; use otlp, console or none")
    return provider


def _ns(t: float | None) -> int | None:
    return int(t * 1e9) if t else None


class Tracing:
    """Starts and ends request spans; every method is a no-op when `enabled` is False."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self.provider = tracer_provider
        self.tracer = None
        if tracer_provider is not None:
            from vsurge.version import __version__

            self.tracer = tracer_provider.get_tracer("vsurge.server", __version__)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Tracing:
        return cls(provider_from_env(env))

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def start(
        self, operation: str, model: str, headers: Mapping[str, str], attributes: dict[str, Any]
    ) -> Any:
        """A span named `{operation} {model}`, child of the caller's traceparent if it sent one."""
        if self.tracer is None:
            return None
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        ctx = propagate.extract(headers)
        attrs = {
            "gen_ai.operation.name": operation,
            "gen_ai.system": "vsurge",
            "gen_ai.provider.name": "vsurge",
            "gen_ai.request.model": model,
            **{k: v for k, v in attributes.items() if v is not None},
        }
        return self.tracer.start_span(
            f"{operation} {model}",
            context=ctx,
            kind=SpanKind.SERVER,
            attributes=attrs,
            start_time=time.time_ns(),
        )

    def finish(
        self,
        span: Any,
        *,
        response_id: str | None = None,
        response_model: str | None = None,
        finish_reasons: list[str] | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        metadata: Any = None,
        error: Any = None,
    ) -> None:
        """Record the outcome and the engine's timestamps as events, then end the span."""
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        if response_id:
            span.set_attribute("gen_ai.response.id", response_id)
        if response_model:
            span.set_attribute("gen_ai.response.model", response_model)
        if finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", [r for r in finish_reasons if r])
        if input_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
        if output_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        if metadata is not None:
            # Timestamps the driver wrote as the request moved; events keep their real times.
            for event, attr in (
                ("gen_ai.request.queued", "queued_at"),
                ("gen_ai.request.prefill_started", "prefill_started_at"),
                ("gen_ai.request.prefill_done", "prefill_done_at"),
                ("gen_ai.response.first_token", "first_token_at"),
            ):
                ts = _ns(getattr(metadata, attr, None))
                if ts:
                    span.add_event(event, timestamp=ts)
        if error is not None:
            status = getattr(error, "status", None)
            span.set_attribute("error.type", getattr(error, "code", None) or type(error).__name__)
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            if status is None or status >= 500:
                span.set_status(Status(StatusCode.ERROR, str(getattr(error, "message", error))[:200]))
        span.end()

    def shutdown(self) -> None:
        if self.provider is not None and hasattr(self.provider, "shutdown"):
            self.provider.shutdown()
