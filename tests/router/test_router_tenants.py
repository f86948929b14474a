"""Tenants: API keys -> tenant, 401 without a valid key, per-tenant models, 429 + Retry-After over a limit,
tokens charged from usage, no wake-up without a key, keys never in a log, and a fuzz of the headers."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_helpers import inference_model, metric_value, wait_for

from vsurge.router.ratelimit import RateLimiter
from vsurge.router.tenants import (
    ApiKeysError,
    Tenant,
    bearer_token,
    digest,
    parse_api_keys,
    parse_api_keys_text,
)

KEY_A = "sk-team-a-0f3c9e2b7d41a8f5"
KEY_B = "sk-team-b-77c1d0e9a3b2f4e6"
KEY_C = "sk-team-c-1a2b3c4d5e6f7a8b"


def _keys_file(tmp_path: Path, tenants: list[dict], name: str = "keys.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path


def _chat(model: str, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ------------------------------------------------------------------------------------------- pure


def test_the_file_maps_keys_to_tenants_in_plain_or_hashed_form() -> None:
    ring = parse_api_keys(
        {
            "tenants": [
                {"name": "a", "keys": [KEY_A, "sha256:" + digest(KEY_C).hex()], "models": ["alpha"]},
                {"name": "b", "keys": [KEY_B], "requestsPerSecond": 2, "tokensPerMinute": 600},
            ]
        }
    )
    assert ring.authenticate(KEY_A).name == "a" and ring.authenticate(KEY_C).name == "a"
    b = ring.authenticate(KEY_B)
    assert b == Tenant("b", requests_per_second=2.0, burst=2.0, tokens_per_minute=600.0)
    assert ring.authenticate(KEY_A + "x") is None and ring.authenticate("") is None
    assert ring.tenants["a"].may_use("alpha") and not ring.tenants["a"].may_use("beta") and b.may_use("beta")


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ({}, "non-empty list"),
        ({"tenants": [{"name": "a", "keys": []}]}, "tenants[0] (a).keys"),
        (
            {"tenants": [{"name": "a", "keys": ["short"]}]},
            "tenants[0] (a).keys[0]: a key must be at least 16",
        ),
        (
            {"tenants": [{"name": "a", "keys": [KEY_A]}, {"name": "b", "keys": [KEY_A]}]},
            "already listed at tenants[0]",
        ),
        ({"tenants": [{"name": "a", "keys": [KEY_A]}, {"name": "a", "keys": [KEY_B]}]}, "listed twice"),
        (
            {"tenants": [{"name": "a", "keys": [KEY_A], "requestsPerSecond": 0}]},
            "requestsPerSecond: expected",
        ),
        ({"tenants": [{"name": "a", "keys": [KEY_A], "burst": 3}]}, "burst: only with requestsPerSecond"),
        ({"tenants": [{"name": "a", "keys": [KEY_A], "color": 1}]}, "unknown key(s) ['color']"),
        ({"tenants": [{"name": "a b", "keys": [KEY_A]}]}, "tenants[0].name"),
        ({"tenants": [{"name": "a", "keys": [KEY_A], "models": "alpha"}]}, "models: expected a list"),
    ],
)
def test_bad_files_are_refused_naming_the_entry_never_the_key(doc: dict, where: str) -> None:
    with pytest.raises(ApiKeysError) as e:
        parse_api_keys(doc)
    assert where in str(e.value)
    assert KEY_A not in str(e.value) and KEY_B not in str(e.value)


def test_a_yaml_error_does_not_quote_the_line() -> None:
    with pytest.raises(ApiKeysError) as e:
        parse_api_keys_text(f"tenants:\n  - name: a\n    keys: [{KEY_A}\n", "keys.yaml")
    assert "keys.yaml: not valid YAML" in str(e.value) and KEY_A not in str(e.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_bearer_parsing_never_raises(header: str) -> None:
    token = bearer_token(header)
    assert token is None or (token and header.strip().lower().startswith("bearer"))
    assert bearer_token(f"Bearer {KEY_A}") == KEY_A and bearer_token(f"bearer   {KEY_A} ") == KEY_A
    assert bearer_token(f"Basic {KEY_A}") is None and bearer_token("Bearer") is None


def test_token_buckets_refill_and_say_when() -> None:
    now = [0.0]
    limiter = RateLimiter(clock=lambda: now[0])
    t = Tenant("t", requests_per_second=2, burst=2, tokens_per_minute=120)
    assert limiter.admit(t) is None and limiter.admit(t) is None
    refusal = limiter.admit(t)
    assert refusal.limit == "requests" and refusal.retry_after == pytest.approx(0.5)
    now[0] += 0.5
    assert limiter.admit(t) is None
    limiter.charge(t, 150)  # one big answer: the bucket (120) goes to -30
    refusal = limiter.admit(t)
    assert refusal.limit == "tokens" and refusal.retry_after == pytest.approx(31 / 2)  # 2 tokens/s
    now[0] += 15.6
    assert limiter.admit(t) is None
    headers = limiter.headers(t)
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-limit-tokens"] == "120"


def test_limits_are_split_over_the_router_replicas() -> None:
    """--tenant-limit-replicas N: each replica enforces 1/N of every limit, so N replicas behind a Service
    admit the limit together, not N times it."""
    now = [0.0]
    t = Tenant("t", requests_per_second=4, burst=8, tokens_per_minute=1200)
    replicas = [RateLimiter(clock=lambda: now[0], replicas=2) for _ in range(2)]
    admitted = sum(1 for _ in range(10) for r in replicas if r.admit(t) is None)
    assert admitted == 8  # the burst, over both replicas
    now[0] += 1.0  # one second: 4 more requests in all, 2 per replica
    assert sum(1 for _ in range(10) for r in replicas if r.admit(t) is None) == 4
    headers = replicas[0].headers(t)
    assert headers["x-ratelimit-limit-requests"] == "4" and headers["x-ratelimit-limit-tokens"] == "600"


# ------------------------------------------------------------------------------------------- live


@pytest.fixture
def tenants_router(tmp_path, upstreams, start_router):
    a = upstreams("a")
    keys = _keys_file(
        tmp_path,
        [
            {"name": "team-a", "keys": [KEY_A], "models": ["alpha"]},
            {"name": "team-b", "keys": ["sha256:" + digest(KEY_B).hex()], "requestsPerSecond": 1, "burst": 2},
            {"name": "team-c", "keys": [KEY_C], "tokensPerMinute": 6},
        ],
    )
    router = start_router(
        {"alpha": [a.url], "beta": [a.url]},
        api_keys_file=str(keys),
        api_keys_reload_seconds=0.05,
        load_poll_seconds=0,
    )
    return router, a, keys


def test_without_a_valid_key_nothing_reaches_a_pod(tenants_router, caplog) -> None:
    router, a, _ = tenants_router
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=router.url, timeout=10) as http:
        r = http.post("/v1/chat/completions", json=_chat("alpha"))
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "invalid_request_error" and "didn't provide an API key" in r.text
        r = http.post("/v1/chat/completions", json=_chat("alpha"), headers=_auth(KEY_A[:-1] + "0"))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert KEY_A[:-1] not in r.text
        assert http.get("/v1/models").status_code == 401
        assert http.get("/liveness").status_code == 200 and http.get("/metrics").status_code == 200
    assert a.requests == []
    # The openai client raises AuthenticationError.
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-wrong-key-0000000000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    text = router.metrics()
    assert metric_value(text, "vsurge_router_auth_failures_total", reason="missing") == 2
    assert metric_value(text, "vsurge_router_auth_failures_total", reason="invalid") == 2
    assert KEY_A[:10] not in caplog.text


def test_a_tenant_sees_and_uses_only_its_models_and_its_key_stays_with_the_router(
    tenants_router, caplog
) -> None:
    router, a, _ = tenants_router
    caplog.set_level(logging.DEBUG)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY_A, max_retries=0)
    assert [m.id for m in client.models.list()] == ["alpha"]
    out = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "hello from a"
    assert "authorization" not in a.requests[-1]["headers"]  # the tenant's key is not the pod's business
    for model in ("beta", "gamma"):  # not allowed, unknown: the same answer
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert "does not exist or you do not have access to it" in e.value.body["message"]
    r = httpx.get(f"{router.url}/v1/models/beta", headers=_auth(KEY_A), timeout=10)
    assert r.status_code == 404
    b = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY_B, max_retries=0)  # no model list: all
    assert sorted(m.id for m in b.models.list()) == ["alpha", "beta"]
    text = router.metrics()
    assert (
        metric_value(text, "vsurge_router_tenant_requests_total", tenant="team-a", model="alpha", code="200")
        == 1
    )
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


def test_over_the_request_rate_is_429_with_retry_after(tenants_router) -> None:
    router, a, _ = tenants_router
    with httpx.Client(base_url=router.url, timeout=10, headers=_auth(KEY_B)) as http:
        codes = [http.post("/v1/chat/completions", json=_chat("beta")) for _ in range(4)]
    refused = [r for r in codes if r.status_code == 429]
    assert codes[0].status_code == 200 and codes[0].headers["x-ratelimit-limit-requests"] == "2"
    assert refused, [r.status_code for r in codes]  # burst 2, refilled at 1/s: four at once cannot all pass
    r = refused[0]
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"] == {
        "message": r.json()["error"]["message"],
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert "Please try again in" in r.json()["error"]["message"]
    assert len(a.requests) == len(codes) - len(refused)
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY_B, max_retries=0).chat.completions.create(
            model="beta", messages=[{"role": "user", "content": "hi"}]
        )
    assert (
        metric_value(router.metrics(), "vsurge_router_rate_limited_total", tenant="team-b", limit="requests")
        >= 2
    )


def test_tokens_are_charged_from_usage_streams_included(tenants_router) -> None:
    router, a, _ = tenants_router
    with httpx.Client(base_url=router.url, timeout=10, headers=_auth(KEY_C)) as http:
        # A stream that did not ask for usage: the router asks, charges it, and takes the frame out again.
        with http.stream("POST", "/v1/chat/completions", json=_chat("beta", stream=True)) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert a.requests[-1]["body"]["stream_options"] == {"include_usage": True}
        payloads = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
        assert events[-1] == "data: [DONE]" and all(p["choices"] for p in payloads)
        # 7 tokens used of 6 a minute: the bucket is below zero, so the next request waits.
        wait_for(
            lambda: (
                metric_value(
                    router.metrics(), "vsurge_router_tenant_tokens_total", tenant="team-c", kind="prompt"
                )
                == 5
            ),
            what="the stream's usage charged",
        )
        r = http.post("/v1/chat/completions", json=_chat("beta"))
        assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
        assert int(r.headers["retry-after"]) >= 10  # 2 tokens missing at 0.1 token/s
    text = router.metrics()
    assert (
        metric_value(
            text, "vsurge_router_tenant_tokens_total", tenant="team-c", model="beta", kind="completion"
        )
        == 2
    )


def test_a_reloaded_file_takes_effect_and_a_broken_one_is_ignored(tenants_router) -> None:
    router, a, keys = tenants_router
    gate = router.app.state.router.gate
    reloads = gate.keys.reloads
    keys.write_text(yaml.safe_dump({"tenants": [{"name": "team-b", "keys": [KEY_B]}]}))
    wait_for(lambda: gate.keys.reloads > reloads, what="the keys file reloaded")
    with httpx.Client(base_url=router.url, timeout=10) as http:
        assert http.post("/v1/chat/completions", json=_chat("alpha"), headers=_auth(KEY_A)).status_code == 401
        assert http.post("/v1/chat/completions", json=_chat("alpha"), headers=_auth(KEY_B)).status_code == 200
        keys.write_text("tenants: [broken\n")
        time.sleep(0.3)  # several reload periods: nothing may change
        assert http.post("/v1/chat/completions", json=_chat("alpha"), headers=_auth(KEY_B)).status_code == 200


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    value=st.text(
        alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=80
    ),
    name=st.sampled_from(["Authorization", "authorization", "X-Api-Key", "Proxy-Authorization"]),
)
def test_header_fuzz_is_401_or_200_never_a_crash(tenants_router, value: str, name: str) -> None:
    router, a, _ = tenants_router
    value = value.strip()
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        json=_chat("alpha"),
        headers={name: value.encode("latin-1")},
        timeout=10,
    )
    valid = name.lower() == "authorization" and bearer_token(value) == KEY_A
    assert r.status_code == (200 if valid else 401)
    assert set(r.json()) == ({"error"} if not valid else set(r.json()))


def test_only_an_authenticated_tenant_can_wake_a_model(cluster, tmp_path, start_router) -> None:
    from vsurge_operator import kube

    api = cluster.client()
    api.create(kube.INFERENCE_MODEL, "models", inference_model("sleepy", replicas=0))
    keys = _keys_file(tmp_path, [{"name": "team-a", "keys": [KEY_A]}])
    router = start_router(
        api_client=cluster.api_client(),
        kubernetes=True,
        namespaces=("models",),
        api_keys_file=str(keys),
        wake_timeout_seconds=0.5,
    )
    wait_for(lambda: httpx.get(f"{router.url}/readiness", timeout=30).status_code == 200, what="router ready")
    for headers in ({}, _auth("sk-not-a-tenant-key-000")):
        r = httpx.post(f"{router.url}/v1/chat/completions", json=_chat("sleepy"), headers=headers, timeout=10)
        assert r.status_code == 401
    assert cluster.requests(method="PATCH", plural="inferencemodels", subresource="scale") == []
    assert cluster.obj("vsurge.io/v1alpha1/inferencemodels", "models", "sleepy")["spec"]["replicas"] == 0
    # The tenant's request wakes it (and times out here: no operator runs to make a replica ready).
    r = httpx.post(
        f"{router.url}/v1/chat/completions", json=_chat("sleepy"), headers=_auth(KEY_A), timeout=10
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_wake_timeout"
    assert cluster.obj("vsurge.io/v1alpha1/inferencemodels", "models", "sleepy")["spec"]["replicas"] == 1
