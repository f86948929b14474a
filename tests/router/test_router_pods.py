"""Picking pods by what they report, prefix affinity and the retry rules, against fake pods on loopback.

Each FakeUpstream answers `GET /load` with the report the test sets (server/load_report.py's shape); the router
polls it every 50 ms here. Verdicts wait for the router to have seen a report (its poll counter), never
for a wall-clock delay.
"""

from __future__ import annotations

import threading
from collections import Counter

import httpx
from kmock_harness import free_port
from router_helpers import load_report, metric_value, wait_for

from vsurge.router.hashring import HashRing
from vsurge.router.prefix import request_hashes

FAST_POLL = {"load_poll_seconds": 0.05}


def _chat(model: str, system: str = "", user: str = "hi", **extra: object) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"model": model, "messages": [*messages, {"role": "user", "content": user}], **extra}


def _polled(router, outcome: str = "ok", at_least: float = 1) -> None:
    def enough() -> bool:
        return metric_value(router.metrics(), "vsurge_router_load_polls_total", outcome=outcome) >= at_least

    wait_for(enough, what=f"{at_least} load polls with outcome {outcome}")


def _upstream(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"].removeprefix("hello from ")


def test_the_pod_with_the_most_headroom_gets_the_requests(upstreams, start_router) -> None:
    busy = upstreams("busy", load=load_report(waiting=3, running=4, slots=4))
    roomy = upstreams("roomy", load=load_report(running=1, slots=4))
    full_kv = upstreams("full-kv", load=load_report(running=0, slots=4, kv=0.97))
    router = start_router({"alpha": [busy.url, roomy.url, full_kv.url]}, routing="least-load", **FAST_POLL)
    _polled(router, at_least=6)  # two rounds: every pod has reported
    with httpx.Client(base_url=router.url, timeout=10) as http:
        got = Counter(_upstream(http.post("/v1/chat/completions", json=_chat("alpha"))) for _ in range(6))
    assert got == {"roomy": 6}
    # The busy pod frees up: the next requests go there (its report now shows the most headroom).
    busy.load = load_report(running=0, slots=4)
    before = metric_value(router.metrics(), "vsurge_router_load_polls_total", outcome="ok")
    _polled(router, at_least=before + 6)
    with httpx.Client(base_url=router.url, timeout=10) as http:
        assert _upstream(http.post("/v1/chat/completions", json=_chat("alpha"))) == "busy"
    text = router.metrics()
    assert (
        metric_value(text, "vsurge_router_picks_total", model="alpha", policy="least-load", how="least_load")
        == 7
    )


def test_a_pod_that_reports_draining_gets_nothing(upstreams, start_router) -> None:
    draining = upstreams("draining", load=load_report(status="draining"))
    ready = upstreams("ready", load=load_report(running=3))
    router = start_router({"alpha": [draining.url, ready.url]}, **FAST_POLL)
    _polled(router, at_least=4)
    with httpx.Client(base_url=router.url, timeout=10) as http:
        assert {_upstream(http.post("/v1/chat/completions", json=_chat("alpha"))) for _ in range(5)} == {
            "ready"
        }
    assert draining.requests == []


def test_a_dead_pod_is_ejected_by_the_poll_before_any_request_fails(upstreams, start_router) -> None:
    a = upstreams("a", load=load_report())
    dead = f"http://127.0.0.1:{free_port()}"
    router = start_router({"alpha": [dead, a.url]}, **FAST_POLL)
    _polled(router, outcome="unreachable")
    with httpx.Client(base_url=router.url, timeout=10) as http:
        assert {_upstream(http.post("/v1/chat/completions", json=_chat("alpha"))) for _ in range(4)} == {"a"}
    text = router.metrics()
    assert (
        metric_value(text, "vsurge_router_upstream_requests_total", upstream=dead, outcome="connect_error")
        == 0
    )
    assert metric_value(text, "vsurge_router_retries_total", model="alpha", reason="connect_error") == 0


def test_a_pod_dropping_the_connection_before_the_first_byte_is_retried(upstreams, start_router) -> None:
    dropper, a = upstreams("dropper", drop=True), upstreams("a")
    router = start_router({"alpha": [dropper.url, a.url]}, load_poll_seconds=0, routing="round-robin")
    with httpx.Client(base_url=router.url, timeout=10) as http:
        for stream in (False, True, False):
            r = http.post("/v1/chat/completions", json=_chat("alpha", stream=stream))
            assert r.status_code == 200 and "from a" in r.text
    text = router.metrics()
    # Tried once (headers came, then the connection went), ejected, then never again.
    assert len(dropper.requests) == 1
    assert (
        metric_value(text, "vsurge_router_upstream_requests_total", upstream=dropper.url, outcome="dropped")
        == 1
    )
    assert metric_value(text, "vsurge_router_retries_total", model="alpha", reason="dropped") == 1


def test_429_and_503_are_retried_once_on_another_pod(upstreams, start_router) -> None:
    busy, draining, ok = upstreams("busy", status=429), upstreams("draining", status=503), upstreams("ok")
    router = start_router(
        {"alpha": [busy.url, ok.url], "beta": [busy.url, draining.url, ok.url]}, load_poll_seconds=0
    )
    with httpx.Client(base_url=router.url, timeout=10) as http:
        for _ in range(4):
            assert _upstream(http.post("/v1/chat/completions", json=_chat("alpha"))) == "ok"
        # A 429 does not eject (the pod is busy, not gone): it keeps being tried when it is its turn.
        assert len(busy.requests) >= 2
        # Only one retry: with two failing pods first in line, the second failure is the answer.
        statuses = Counter()
        for _ in range(6):
            statuses[http.post("/v1/chat/completions", json=_chat("beta")).status_code] += 1
    text = router.metrics()
    assert metric_value(text, "vsurge_router_retries_total", model="alpha", reason="busy") >= 2
    attempts = sum(
        metric_value(text, "vsurge_router_upstream_requests_total", model="beta", upstream=u.url, outcome=o)
        for u in (busy, draining, ok)
        for o in ("200", "429", "503")
    )
    assert attempts <= 12 and statuses[200] >= 1  # never more than two attempts per request


def test_prefix_routing_keeps_each_system_prompt_on_one_pod(upstreams, start_router) -> None:
    pods = [upstreams(f"p{i}", load=load_report(driver="odriver")) for i in range(3)]
    router = start_router({"alpha": [p.url for p in pods]}, **FAST_POLL)  # auto: the pods run odriver
    _polled(router, at_least=6)
    systems = [
        f"You are assistant number {k}. " + "Follow the house rules carefully. " * 40 for k in range(8)
    ]
    where: dict[int, set[str]] = {k: set() for k in range(8)}
    with httpx.Client(base_url=router.url, timeout=10) as http:
        for user in range(5):
            for k, system in enumerate(systems):
                r = http.post("/v1/chat/completions", json=_chat("alpha", system=system, user=f"user {user}"))
                where[k].add(_upstream(r))
    # Sequential requests never load a pod: each prompt always lands on the ring owner of its key block
    # (the 4th block of 256 bytes, inside the system prompt), whoever the user is.
    ring = HashRing([p.url for p in pods])
    names = {p.url: p.name for p in pods}
    for k, system in enumerate(systems):
        key = request_hashes("/v1/chat/completions", _chat("alpha", system=system), "alpha", 256)[3]
        assert where[k] == {names[ring.owner(key)]}, (k, where)
    text = router.metrics()
    picks = sum(
        metric_value(text, "vsurge_router_picks_total", model="alpha", policy="prefix", how=how)
        for how in ("prefix_hash", "prefix_match")
    )
    assert picks == 40


def test_prefix_routing_spills_a_hot_prompt_within_the_bound(upstreams, start_router) -> None:
    gate = threading.Event()
    pods = [upstreams(f"p{i}", gate=gate) for i in range(3)]
    router = start_router({"alpha": [p.url for p in pods]}, routing="prefix", load_poll_seconds=0)
    system = "One popular system prompt. " * 40
    held = []
    with httpx.Client(base_url=router.url, timeout=10) as http:
        try:
            for i in range(9):  # streams held open by the gate: each one loads its pod
                r = http.send(
                    http.build_request(
                        "POST", "/v1/chat/completions", json=_chat("alpha", system, f"u{i}", stream=True)
                    ),
                    stream=True,
                )
                lines = r.iter_lines()  # kept: a dropped line iterator closes the stream
                next(lines)
                held.append((r, lines))
            loads = sorted(p.open for p in pods)
        finally:
            gate.set()
            for r, _ in held:
                r.close()
    # 9 requests, 3 pods, eps 0.25: no pod above ceil(1.25 * 9 / 3) = 4, so the hot prompt spilled over
    # all of them (in ring order, the same for every router replica).
    assert sum(loads) == 9 and max(loads) <= 4 and min(loads) >= 1, loads
