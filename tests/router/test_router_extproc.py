"""The router as the Gateway API Inference Extension's endpoint picker (router/extproc.py), driven by a real
gRPC ext_proc client built from the published Envoy protos (xds-protos: envoy.service.ext_proc.v3), as a
Gateway's proxy would drive it: request headers, then the body, in full-duplex streamed mode (the
protocol's) or buffered; the answers read as the proxy reads them (the header and the dynamic metadata
`envoy.lb` / `x-gateway-destination-endpoint`, or an immediate response).

The pods are FakeUpstreams that report `/load` as `vsurge serve` does, so the picks are the router's own
policies on real load reports: prefix affinity on paged-driver pods, least load by queue and KV use.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from kmock_harness import free_port
from router_helpers import load_report, metric_value, wait_for

Mode = processing_mode_pb2.ProcessingMode


def _headers(pairs: dict[str, str], end_of_stream: bool) -> ext_proc.HttpHeaders:
    return ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=end_of_stream,
    )


def _messages(
    body: dict[str, Any] | None,
    *,
    headers: dict[str, str] | None = None,
    subset: list[str] | None = None,
    mode: int = Mode.FULL_DUPLEX_STREAMED,
) -> list[ext_proc.ProcessingRequest]:
    """What an Envoy proxy sends for one POST: headers (with the protocol config and the subset hint in
    the filter metadata), then the body in two chunks."""
    pairs = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
    pairs.update(headers or {})
    first = ext_proc.ProcessingRequest(
        request_headers=_headers(pairs, end_of_stream=body is None),
        protocol_config=ext_proc.ProtocolConfiguration(
            request_body_mode=mode, response_body_mode=Mode.FULL_DUPLEX_STREAMED
        ),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    out = [first]
    if body is not None:
        raw = json.dumps(body).encode()
        half = len(raw) // 2
        out.append(ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=raw[:half])))
        out.append(
            ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=raw[half:], end_of_stream=True))
        )
    return out


class Proxy:
    """The proxy's side of the stream."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = ext_proc_grpc.ExternalProcessorStub(self.channel)

    def process(self, messages: list[ext_proc.ProcessingRequest]) -> list[ext_proc.ProcessingResponse]:
        return list(self.stub.Process(iter(messages), timeout=10))

    def pick(self, body: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
        """The answer as the proxy reads it: endpoints (header and metadata must agree), the other headers
        set and removed, the body handed back; or the immediate response's status and body."""
        answers = self.process(_messages(body, **kw))
        first = answers[0]
        if first.HasField("immediate_response"):
            r = first.immediate_response
            return {"status": r.status.code, "body": json.loads(r.body)}
        common = (
            first.request_headers.response
            if first.HasField("request_headers")
            else first.request_body.response
        )
        set_headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
        meta = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        endpoint_meta = meta["x-gateway-destination-endpoint"].string_value
        assert set_headers["x-gateway-destination-endpoint"] == endpoint_meta
        assert common.clear_route_cache
        echoed = b"".join(a.request_body.response.body_mutation.streamed_response.body for a in answers[1:])
        return {
            "status": 200,
            "endpoints": endpoint_meta.split(","),
            "headers": set_headers,
            "removed": list(common.header_mutation.remove_headers),
            "echoed": echoed,
            "answers": len(answers),
        }

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def gateway(
    upstreams: Callable[..., Any], start_router: Callable[..., Any], tmp_path: Path
) -> Iterator[Callable[..., tuple[Proxy, list[Any]]]]:
    proxies: list[Proxy] = []

    def make(n: int = 3, driver: str = "odriver", **config: Any) -> tuple[Proxy, list[Any]]:
        pods = [upstreams(f"pod{i}", load=load_report(driver=driver, model="alpha")) for i in range(n)]
        port = free_port()
        router = start_router(
            {"alpha": [p.url for p in pods]}, ext_proc_port=port, load_poll_seconds=0.05, **config
        )
        proxy = Proxy(port)
        proxies.append(proxy)
        # every pod's load report is in (its driver decides the policy: prefix for odriver)
        wait_for(
            lambda: metric_value(router.metrics(), "vsurge_router_load_polls_total", outcome="ok") >= 3 * n,
            what="load reports",
        )
        return proxy, pods

    yield make
    for p in proxies:
        p.close()


def _endpoint(pod: Any) -> str:
    return pod.url.split("://", 1)[1]


SYSTEM = [
    f"You are assistant number {i}. " + ("Follow the house style guide closely. " * 40) for i in range(6)
]


def _chat(system: str, user: str) -> dict[str, Any]:
    return {
        "model": "alpha",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def test_prefix_workload_keeps_each_system_prompt_on_one_pod(gateway: Callable[..., Any]) -> None:
    proxy, pods = gateway()
    picks: dict[int, Counter[str]] = {i: Counter() for i in range(len(SYSTEM))}
    for turn in range(4):
        for i, system in enumerate(SYSTEM):
            answer = proxy.pick(_chat(system, f"question {turn}"))
            assert answer["status"] == 200
            # the body is handed back whole (full-duplex mode), after the headers' answer
            assert json.loads(answer["echoed"])["messages"][0]["content"] == system
            primary, *fallbacks = answer["endpoints"]
            assert len(fallbacks) == 2 and len(set(answer["endpoints"])) == 3
            picks[i][primary] += 1
    print("\nendpoint picks per system prompt (4 requests each):")
    for i, c in picks.items():
        print(f"  system prompt {i}: {dict(c)}")
    # every system prompt stays on one pod, and the prompts are spread over the pods
    assert all(len(c) == 1 for c in picks.values())
    used = {next(iter(c)) for c in picks.values()}
    assert len(used) >= 2
    assert used <= {_endpoint(p) for p in pods}


def test_least_load_avoids_a_full_queue_and_full_kv(gateway: Callable[..., Any]) -> None:
    proxy, pods = gateway(driver="vdriver")
    pods[0].load = load_report(waiting=6, running=4, slots=4, model="alpha")
    pods[1].load = load_report(running=0, slots=4, kv=0.97, model="alpha")
    pods[2].load = load_report(running=1, slots=4, kv=0.1, model="alpha")
    roomy = _endpoint(pods[2])
    wait_for(lambda: proxy.pick({"model": "alpha", "messages": []})["endpoints"][0] == roomy, timeout=10)
    answer = proxy.pick({"model": "alpha", "messages": [{"role": "user", "content": "hi"}]})
    assert answer["endpoints"][0] == roomy


def test_subset_hint_restricts_the_pick(gateway: Callable[..., Any]) -> None:
    proxy, pods = gateway()
    only = _endpoint(pods[1])
    for system in SYSTEM:
        answer = proxy.pick(_chat(system, "q"), subset=[only])
        assert answer["endpoints"] == [only]
    refused = proxy.pick(_chat(SYSTEM[0], "q"), subset=[])
    assert refused["status"] == 503


def test_buffered_mode_answers_the_body(gateway: Callable[..., Any]) -> None:
    proxy, _pods = gateway()
    answers = proxy.process(_messages(_chat(SYSTEM[0], "q"), mode=Mode.BUFFERED))
    # buffered: the headers are let through at once, the pick comes with the body
    assert answers[0].HasField("request_headers")
    assert not answers[0].request_headers.response.header_mutation.set_headers
    pick = [h.header.key for h in answers[-1].request_body.response.header_mutation.set_headers]
    assert "x-gateway-destination-endpoint" in pick


def test_unknown_model_and_no_model(gateway: Callable[..., Any]) -> None:
    proxy, _pods = gateway()
    assert proxy.pick({"model": "nope", "messages": []})["status"] == 404
    assert proxy.pick({"messages": []})["status"] == 400
    # no body: the model comes from the header the Gateway's body-based routing sets
    by_header = proxy.pick(None, headers={"x-gateway-model-name": "alpha", ":method": "GET"})
    assert by_header["status"] == 200


def test_tenants_are_checked_in_gateway_mode(gateway: Callable[..., Any], tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "tenants": [
                    {"name": "team-a", "keys": ["sk-team-a-0123456789abcdef"], "models": ["alpha"]},
                    {"name": "team-b", "keys": ["sk-team-b-0123456789abcdef"], "models": ["other"]},
                    {
                        "name": "slow",
                        "keys": ["sk-slow-0123456789abcdef00"],
                        "requestsPerSecond": 0.01,
                        "burst": 1,
                    },
                ]
            }
        )
    )
    proxy, _pods = gateway(api_keys_file=str(keys))
    body = _chat(SYSTEM[0], "q")
    assert proxy.pick(body)["status"] == 401
    assert proxy.pick(body, headers={"authorization": "Bearer sk-wrong-0123456789abcdef"})["status"] == 401
    assert proxy.pick(body, headers={"authorization": "Bearer sk-team-b-0123456789abcdef"})["status"] == 404
    ok = proxy.pick(body, headers={"authorization": "Bearer sk-team-a-0123456789abcdef"})
    assert ok["status"] == 200
    assert ok["removed"] == ["authorization"]  # the tenant's key never reaches the pod
    slow = {"authorization": "Bearer sk-slow-0123456789abcdef00"}
    assert proxy.pick(body, headers=slow)["status"] == 200
    limited = proxy.pick(body, headers=slow)
    assert limited["status"] == 429 and limited["body"]["error"]["code"] == "rate_limit_exceeded"
