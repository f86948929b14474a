"""One trace across the router and the engine: the router's span (GenAI attributes, the chosen pod, the
retries) is the parent of the engine's span, because the router sends its own `traceparent` upstream.

A real vSurgeApiServer (the server suite's tiny model and shapes, so the compilation cache is shared) and
a real router, both on loopback in this process, both exporting to one in-memory exporter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import openai
import pytest
import yaml
from kmock_harness import free_port
from router_helpers import REPO, RunningRouter, ThreadedServer, wait_for

sys.path.insert(0, str(REPO / "tests" / "server"))
from server_helpers import MODEL, make_surge  # noqa: E402
from tiny_models import make_checkpoint  # noqa: E402

CLIENT_TRACE, CLIENT_SPAN = 0x5CE0E9A56015FEC5AADFA328AE398115, 0x0123456789ABCDEF


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vsurge.router.app import build_app
    from vsurge.router.config import RouterConfig
    from vsurge.server import start, vSurgeApiServer

    root = tmp_path_factory.mktemp("router-trace")
    make_checkpoint(root / "tiny", "llama", seed=0)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    surge = make_surge(str(root / "tiny"))
    api = vSurgeApiServer({MODEL: surge}, tracer_provider=provider, owns_engines=False)
    server = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=True, progress=None)
    server.wait_ready(600)
    dead = f"http://127.0.0.1:{free_port()}"
    config = root / "static.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": MODEL, "upstreams": [dead, server.url]}]}))
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        static_config=str(config),
        kubernetes=False,
        routing="round-robin",
        load_poll_seconds=0,
    )
    router = RunningRouter(
        ThreadedServer(build_app(cfg, tracer_provider=provider), as_router=True).start(), None
    )
    try:
        yield router, server, dead, exporter
    finally:
        router.server.stop()
        server.stop()
        surge.stop()


def _spans(exporter, trace_id: int, count: int) -> list:
    def found() -> list:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        return spans if len(spans) >= count else []

    return wait_for(found, what=f"{count} spans of trace {trace_id:032x}")


def test_router_and_engine_spans_form_one_trace(traced) -> None:
    router, server, dead, exporter = traced
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
    traces = []
    for i in range(2):  # round robin over [dead, live]: one of the two requests tries the dead pod first
        trace_id = CLIENT_TRACE + i
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "trace me"}],
            max_tokens=4,
            temperature=0.5,
            extra_headers={"traceparent": f"00-{trace_id:032x}-{CLIENT_SPAN:016x}-01"},
        )
        traces.append((trace_id, out))
    retried = 0
    for trace_id, out in traces:
        spans = _spans(exporter, trace_id, 2)
        assert len(spans) == 2
        (mine,) = [s for s in spans if s.instrumentation_scope.name == "vsurge.router"]
        (engine,) = [s for s in spans if s.instrumentation_scope.name == "vsurge.server"]
        # One trace: the client's span -> the router's span -> the engine's span.
        assert mine.parent is not None and mine.parent.span_id == CLIENT_SPAN and mine.parent.is_remote
        assert engine.parent is not None and engine.parent.span_id == mine.context.span_id
        assert mine.start_time <= engine.start_time and engine.end_time <= mine.end_time
        a = mine.attributes
        assert mine.name == f"chat {MODEL}" and mine.kind.name == "SERVER"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.5
        assert a["vsurge.router.upstream"] == server.url  # the chosen pod
        assert a["server.address"] == "127.0.0.1" and a["server.port"] == int(server.url.rsplit(":", 1)[1])
        assert a["vsurge.router.policy"] == "round-robin" and a["http.response.status_code"] == 200
        assert a["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == out.usage.completion_tokens
        if a["vsurge.router.retries"]:
            retried += 1
            assert tuple(a["vsurge.router.attempts"]) == (f"{dead} connect_error", f"{server.url} ok")
    assert retried == 1
