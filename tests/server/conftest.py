"""Shared fixtures of the server suite: one tiny model, one compiled vSurge, one real uvicorn server.

Everything heavy is session-scoped: the tiny checkpoint is made once, its vSurge compiled once (small
max_length and prefill buckets keep that to seconds), and the main server is started once on loopback.
Tests that need a differently configured server (TLS + API key, not ready) start another
vSurgeApiServer over the same engine; starting one costs only a uvicorn thread.
"""

from __future__ import annotations

import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "service"))

from server_helpers import MODEL, make_surge  # noqa: E402
from tiny_models import make_checkpoint  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: the short soak (many concurrent clients for ~10 s)")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-llama")
    make_checkpoint(d, "llama", seed=0)
    return str(d)


@pytest.fixture(scope="session")
def surge(tiny_dir):
    s = make_surge(tiny_dir)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def span_exporter():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter()


@pytest.fixture(scope="session")
def server(surge, span_exporter):
    """The main server: real uvicorn on 127.0.0.1, /metrics on the main port, spans kept in memory.

    Started before warm-up so the readiness answer seen then is kept in `server.readiness_before_warmup`.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from vsurge.server import start, vSurgeApiServer

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    api = vSurgeApiServer({MODEL: surge}, tracer_provider=provider, owns_engines=False)
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    before = httpx.get(f"{running.url}/readiness", timeout=10)
    running.readiness_before_warmup = (before.status_code, before.json())  # type: ignore[attr-defined]
    api.warm_up()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return f"{server.url}/v1"


@pytest.fixture(scope="session")
def client(base_url):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
