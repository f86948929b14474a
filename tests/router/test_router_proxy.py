"""The router in front of fake upstreams, all on loopback: routing, streaming, retries, errors, metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from kmock_harness import free_port
from router_helpers import metric_value, wait_for


def _chat(model: str, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_models_are_listed_and_requests_go_by_model(upstreams, start_router) -> None:
    a, b = upstreams("a"), upstreams("b")
    router = start_router({"alpha": [a.url], "beta": [f"{b.url}/v1"]})
    with httpx.Client(base_url=router.url, timeout=10) as http:
        assert http.get("/liveness").status_code == 200
        assert http.get("/readiness").json() == {"status": "ready", "models": 2}
        listing = http.get("/v1/models").json()
        assert listing["object"] == "list"
        assert [(m["id"], m["object"], m["owned_by"], m["ready"]) for m in listing["data"]] == [
            ("alpha", "model", "vsurge", True),
            ("beta", "model", "vsurge", True),
        ]
        assert http.get("/v1/models/beta").json()["id"] == "beta"

        r = http.post("/v1/chat/completions", json=_chat("alpha"))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello from a"
        r = http.post("/v1/chat/completions", json=_chat("beta"))
        assert r.json()["choices"][0]["message"]["content"] == "hello from b"
        for path in ("/v1/completions", "/v1/count_tokens", "/tokenize", "/detokenize"):
            r = http.post(f"{path}?x=1", json={"model": "beta", "prompt": "hi"})
            assert r.status_code == 200 and r.json() == {"upstream": "b", "path": path, "model": "beta"}
        assert b.requests[-1]["query"] == "x=1"
    assert len(a.requests) == 1 and len(b.requests) == 5


def test_headers_pass_through_but_hop_by_hop_ones_do_not(upstreams, start_router) -> None:
    a = upstreams("a")
    router = start_router({"alpha": [a.url]})
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        json=_chat("alpha"),
        timeout=10,
        headers={
            "traceparent": traceparent,
            "tracestate": "vendor=1",
            "Authorization": "Bearer sk-test",
            "X-Custom": "kept",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "dropped",
            "X-Forwarded-For": "10.0.0.1",
        },
    )
    assert r.status_code == 200 and r.headers["x-upstream"] == "a"
    seen = a.requests[-1]["headers"]
    assert seen["traceparent"] == traceparent and seen["tracestate"] == "vendor=1"
    assert seen["authorization"] == "Bearer sk-test" and seen["x-custom"] == "kept"
    assert "x-hop" not in seen
    assert seen["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
    assert seen["host"] == a.url.removeprefix("http://")
    assert r.headers.get_list("date") and len(r.headers.get_list("date")) == 1 and "server" not in r.headers
    # Nothing the client did not send is added: above all no Accept-Encoding (bodies are relayed raw).
    with httpx.Client(timeout=10) as http:
        for name in ("accept-encoding", "user-agent", "accept"):
            del http.headers[name]
        assert http.post(f"{router.url}/v1/chat/completions", json=_chat("alpha")).status_code == 200
    assert {"accept-encoding", "user-agent", "accept"}.isdisjoint(a.requests[-1]["headers"])


def test_streams_pass_through_unbuffered(upstreams, start_router) -> None:
    gate = threading.Event()
    a = upstreams("a", gate=gate)
    router = start_router({"alpha": [a.url]})
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", f"{router.url}/v1/chat/completions", json=_chat("alpha", stream=True)) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(lines)
        # The upstream holds the rest until the gate opens: the first event got here on its own.
        assert not gate.is_set() and json.loads(first.removeprefix("data: "))["choices"][0]["delta"][
            "content"
        ] == ("first from a")
        gate.set()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and "second" in rest[0]


def test_the_least_loaded_replica_gets_the_next_request(upstreams, start_router) -> None:
    gate = threading.Event()
    a, b = upstreams("a", gate=gate), upstreams("b", gate=gate)
    router = start_router({"alpha": [a.url, b.url]})
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", f"{router.url}/v1/chat/completions", json=_chat("alpha", stream=True)) as held,
    ):
        held_lines = held.iter_lines()  # kept: a dropped line iterator closes the stream
        next(held_lines)
        busy, idle = (a, b) if a.open else (b, a)
        assert busy.open == 1 and idle.open == 0
        # While one replica has a stream open, new requests all go to the other one.
        for _ in range(3):
            with http.stream(
                "POST", f"{router.url}/v1/chat/completions", json=_chat("alpha", stream=True)
            ) as r:
                assert next(r.iter_lines()).count(f"first from {idle.name}") == 1
            # The router counts a stream until it has closed it; wait for that before the next one.
            wait_for(
                lambda: (
                    metric_value(router.metrics(), "vsurge_router_requests_in_flight", model="alpha") == 1
                ),
                what="the short stream to be released",
            )
        gate.set()
    assert len(busy.requests) == 1 and len(idle.requests) == 3
    text = router.metrics()
    wait_for(
        lambda: metric_value(router.metrics(), "vsurge_router_requests_in_flight", model="alpha") == 0,
        what="in-flight gauge back to 0",
    )
    assert metric_value(text, "vsurge_router_requests_total", model="alpha", code="200") == 4
    assert metric_value(text, "vsurge_router_upstream_latency_seconds_count", model="alpha") == 4


def test_a_refused_connection_is_retried_on_another_replica(upstreams, start_router) -> None:
    a = upstreams("a")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    # No /load polling: the first request must find out the hard way (the next test polls).
    router = start_router({"alpha": [dead, a.url]}, load_poll_seconds=0)
    with httpx.Client(timeout=10) as http:
        for _ in range(4):
            r = http.post(f"{router.url}/v1/chat/completions", json=_chat("alpha"))
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello from a"
    text = router.metrics()
    # The dead replica was tried once, then ejected: the other requests went straight to the live one.
    assert (
        metric_value(text, "vsurge_router_upstream_requests_total", upstream=dead, outcome="connect_error")
        == 1
    )
    assert metric_value(text, "vsurge_router_retries_total", model="alpha", reason="connect_error") == 1
    assert len(a.requests) == 4


def test_a_draining_replica_is_skipped_and_the_last_503_passes_through(upstreams, start_router) -> None:
    draining, a = upstreams("draining", status=503), upstreams("a")
    router = start_router({"alpha": [draining.url, a.url], "beta": [draining.url]})
    with httpx.Client(timeout=10) as http:
        for _ in range(3):
            assert http.post(f"{router.url}/v1/chat/completions", json=_chat("alpha")).status_code == 200
        r = http.post(f"{router.url}/v1/chat/completions", json=_chat("beta"))
    assert r.status_code == 503 and r.json()["error"]["message"] == "draining says 503"
    assert r.headers["retry-after"] == "1"


def test_no_reachable_replica_is_a_503_with_retry_after(start_router) -> None:
    router = start_router(
        {"alpha": [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], "empty": []},
        retry_after_seconds=7,
    )
    r = httpx.post(f"{router.url}/v1/chat/completions", json=_chat("alpha"), timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["code"] == "upstream_unavailable" and r.json()["error"]["type"] == "server_error"
    r = httpx.post(f"{router.url}/v1/chat/completions", json=_chat("empty"), timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_upstreams"
    assert httpx.get(f"{router.url}/v1/models/empty", timeout=10).json()["ready"] is False


@pytest.mark.parametrize(
    ("body", "status", "param", "fragment"),
    [
        (b"{not json", 400, None, "could not parse the JSON body"),
        (b"[1, 2]", 400, None, "must be a JSON object"),
        (b'{"messages": []}', 400, "model", "provide a model"),
        (b'{"model": 7}', 400, "model", "provide a model"),
        (b'{"model": "nope"}', 404, "model", "The model `nope` does not exist"),
        (b'{"model": "alpha", "x": "' + b"y" * 2048 + b'"}', 413, None, "larger than 1024 bytes"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(
    upstreams, start_router, body, status, param, fragment
) -> None:
    a = upstreams("a")
    router = start_router({"alpha": [a.url]}, max_body_bytes=1024)
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        content=body,
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and fragment in error["message"]
    assert a.requests == []


def test_unknown_routes_and_methods(start_router) -> None:
    router = start_router({"alpha": []})
    r = httpx.get(f"{router.url}/v1/audio/transcriptions", timeout=10)  # a route no pod serves
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{router.url}/v1/embeddings", timeout=10)  # forwarded, but POST only
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(f"{router.url}/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(f"{router.url}/v1/models/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_client_that_leaves_cancels_the_upstream_request(upstreams, start_router) -> None:
    gate = threading.Event()
    a = upstreams("a", gate=gate)
    router = start_router({"alpha": [a.url]})
    # Non-streamed: the router is waiting for the upstream's headers when the client goes.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{router.url}/v1/chat/completions", json=_chat("alpha"), timeout=httpx.Timeout(10, read=0.5)
        )
    wait_for(lambda: a.cancelled == 1, what="the upstream to see the disconnect")
    # Streamed: the client reads one event and hangs up.
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", f"{router.url}/v1/chat/completions", json=_chat("alpha", stream=True)) as r,
    ):
        next(r.iter_lines())
    wait_for(lambda: a.cancelled == 2 and a.open == 0, what="the upstream stream to be cancelled")
    wait_for(
        lambda: metric_value(router.metrics(), "vsurge_router_requests_in_flight", model="alpha") == 0,
        what="in-flight gauge back to 0",
    )
    assert metric_value(router.metrics(), "vsurge_router_requests_total", model="alpha", code="499") == 1
    time.sleep(0.05)
    assert not gate.is_set()
