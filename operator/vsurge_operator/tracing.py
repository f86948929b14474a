"""OpenTelemetry for the operator itself: a span per reconcile and per scale decision.

Tracing is configured from the standard ``OTEL_*`` environment (the Helm chart sets
``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``, the sampler...). Without an endpoint the API's
no-op tracer is used, so spans cost nearly nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Status, StatusCode

INSTRUMENTATION = "vsurge_operator"

_provider: TracerProvider | None = None


def configure(
    *, exporter: SpanExporter | None = None, service_name: str = "vsurge-operator", set_global: bool = True
) -> TracerProvider | None:
    """Install a tracer provider: ``exporter`` if given (tests), else OTLP when an endpoint is configured."""
    global _provider
    if exporter is None:
        if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") and not os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        ):
            return None
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        processor: Any = BatchSpanProcessor(OTLPSpanExporter())
    else:
        processor = SimpleSpanProcessor(exporter)
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(processor)
    _provider = provider
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def shutdown() -> None:
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    provider = _provider or trace.get_tracer_provider()
    return provider.get_tracer(INSTRUMENTATION)


@contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[trace.Span]:
    """A span that records an escaping exception as an error and re-raises it."""
    with tracer().start_as_current_span(name, record_exception=False, set_status_on_exception=False) as s:
        for key, value in (attributes or {}).items():
            if value is not None:
                s.set_attribute(key, value)
        try:
            yield s
        except BaseException as e:
            s.record_exception(e)
            s.set_status(Status(StatusCode.ERROR, str(e)[:200]))
            raise
