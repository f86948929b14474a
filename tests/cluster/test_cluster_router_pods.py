"""The router picks pods, not Services, on the real API server: the operator's Service, the kit's real
EndpointSlice controller, three real `vsurge serve` pods (tiny model, odriver) on 127.0.0.X, `vsurge route`.

The test plays the scheduler and the kubelet only: the operator's pods are bound to a Node object and
reported Running + Ready on the IPs where the servers listen. The InferenceModel's `status.endpoint` (the
Service's DNS name) resolves nowhere on this machine, so every answer proves the request went to a pod.

On those three pods, the shared-system-prompt workload of benchmarks/router_prefix.py runs once per
policy (`least-load`, `prefix`, `round-robin`, one `vsurge route` each, one request at a time so that no
load bound comes into play), as tests/router/test_router_e2e_pods.py does on a static config: `prefix`
misses once per system prompt, the others more; the pods' own prefix-cache counters agree with the
answers' usage. A pod turning unready (what its preStop does) leaves the router's list before its server
is stopped (SIGTERM): no client sees an error. A pod killed outright (its EndpointSlice still lists it: no
kubelet notices) costs at most the streams that had started on it.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import httpx
import pytest
from clusterkit import (
    IM,
    REPO,
    Kubelet,
    clean_env,
    ensure_node,
    inference_model,
    next_pod_ip,
    serve,
    start_operator,
    vsurge_command,
    wait_for,
)
from kmock_harness import LoggedProcess, free_port

from vsurge_operator import kube

sys.path.insert(0, str(REPO / "tests" / "router"))
from router_helpers import load_benchmark, metric_value  # noqa: E402

pytestmark = pytest.mark.timeout(600)

bench = load_benchmark("router_prefix")
MODEL = "pods"
NODE = "router-test-node"
USERS = 3  # users per system prompt in the policy comparison (8 prompts)


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def _ip(url: str) -> str:
    return url.removeprefix("http://").rsplit(":", 1)[0]


def _upstreams(url: str) -> float:
    return metric_value(_metrics(url), "vsurge_router_model_upstreams", model=MODEL)


def _pod_hits(ips: list[str]) -> dict[str, float]:
    """Each pod's own count of prefills that reused cached pages (its /metrics, port 11557)."""
    return {
        ip: metric_value(_metrics(f"http://{ip}:11557"), "vsurge_prefix_cache_hits_total", model=MODEL)
        for ip in ips
    }


def _slices(api: kube.Kube, namespace: str) -> list[dict]:
    return api.request("GET", f"/apis/discovery.k8s.io/v1beta1/namespaces/{namespace}/endpointslices")[
        "items"
    ]


def test_requests_go_to_the_ready_pods_of_the_service(k8s, namespace, tmp_path: Path) -> None:
    from tiny_models import make_checkpoint

    api = k8s.kube()
    ensure_node(api, NODE)
    make_checkpoint(tmp_path / "tiny", "llama", seed=0)
    ips = [next_pod_ip() for _ in range(3)]
    servers = [
        serve(tmp_path / "tiny", ip, tmp_path / f"serve-{i}.log", MODEL, *bench.SERVE_FLAGS)
        for i, ip in enumerate(ips)
    ]
    free_ips = list(ips)
    kubelet = Kubelet(api, namespace, ip_for=lambda pod: free_ips.pop(0) if free_ips else None, node=NODE)
    operator = start_operator(k8s.kubeconfig, tmp_path / "operator.log", f"--namespace={namespace}")
    routers: list[LoggedProcess] = []

    def start_router(name: str, *flags: str) -> str:
        """A `vsurge route` watching the namespace, once it lists the three pods; its URL."""
        port = free_port()
        proc = LoggedProcess(
            [*vsurge_command(), "route", "--host=127.0.0.1", f"--port={port}", f"--namespace={namespace}",
             *bench.ROUTER_FLAGS, *flags],
            tmp_path / f"router-{name}.log",
            clean_env(KUBECONFIG=str(k8s.kubeconfig)),
        ).start()  # fmt: skip
        routers.append(proc)
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/readiness", timeout=60)
        wait_for(lambda: _upstreams(url) == 3, 60, message=f"the {name} router lists the three pods")
        return url

    try:
        for ip, server in zip(ips, servers, strict=True):
            server.wait_http(f"http://{ip}:11556/readiness", timeout=300)
        kubelet.start()
        api.create(IM, namespace, inference_model(MODEL, namespace, replicas=3))
        wait_for(lambda: len([s for s in _slices(api, namespace) for e in s.get("endpoints") or ()]) == 3, 90,
                 message="three endpoints in the model Service's EndpointSlices")  # fmt: skip
        url = start_router("round-robin", "--routing=round-robin", "--eject-seconds=60")
        pods = {f"http://{ip}:11556" for ip in ips}
        endpoint = api.get(IM, namespace, MODEL)["status"]["endpoint"]
        assert ".svc.cluster.local" in endpoint  # the Service URL: not reachable here, never used

        # Per request, to each pod in turn.
        work = bench.jobs(bench.system_prompts(4, 24, seed=500), 3, seed=5)
        results, _ = asyncio.run(bench.run(url, MODEL, work, concurrency=1, max_tokens=4))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        text = _metrics(url)
        per_pod = {
            p: metric_value(
                text, "vsurge_router_upstream_requests_total", model=MODEL, upstream=p, outcome="200"
            )
            for p in pods
        }
        assert per_pod == dict.fromkeys(pods, 4.0), per_pod

        # The policies on the shared-system-prompt workload: 8 system prompts x 3 users, each policy its own
        # prompts (no pages left from another run), one request at a time through its own router.
        rows, runs = [], {}
        for i, policy in enumerate(("least-load", "prefix", "round-robin")):  # the benchmark's order
            # Load polling off for prefix: its loads are then exactly the router's (zero between requests).
            no_poll = ["--load-poll-seconds=0"] if policy == "prefix" else []
            purl = start_router(policy, f"--routing={policy}", *no_poll)
            work = bench.jobs(bench.system_prompts(8, 24, seed=600 + i), USERS, seed=60 + i)
            before = _pod_hits(ips)
            results, wall = asyncio.run(bench.run(purl, MODEL, work, concurrency=1, max_tokens=4))
            after = _pod_hits(ips)
            text = _metrics(purl)
            routers.pop().stop()
            s = bench.summarize(results, wall)
            assert s.errors == 0, s.error_samples
            picks = sum(
                metric_value(text, "vsurge_router_picks_total", model=MODEL, policy=policy, how=how)
                for how in ("prefix_match", "prefix_hash", "least_load", "round_robin")
            )
            assert picks == len(work)
            per_pod = [int(after[ip] - before[ip]) for ip in ips]
            assert sum(per_pod) == s.hits, (per_pod, s.hits)  # the pods' counters agree with the answers
            runs[policy] = s
            rows.append(
                f"| {policy} | {s.requests} | {s.errors} | {s.hit_rate:.1%} | {s.hits} | {per_pod} | "
                f"{s.tok_per_s:.1f} | {s.ttft_p50_ms:.0f} |"
            )
        print(
            "\nrouter pods on the kit: 8 system prompts x 3 users, one request at a time, 4 tokens each\n"
            "| policy | requests | errors | prefix-cache hit rate (tokens) | answers with a hit | "
            "hits per pod (pod metrics) | output tok/s | TTFT p50 (ms) |\n"
            "|---|---:|---:|---:|---:|---|---:|---:|\n" + "\n".join(rows)
        )
        assert runs["prefix"].hits == 8 * (USERS - 1)  # one miss per system prompt, then hits only
        for other in ("round-robin", "least-load"):
            assert runs[other].hits < runs["prefix"].hits
            assert runs[other].hit_rate < runs["prefix"].hit_rate

        # Drain: the pod turns unready (its preStop's signal), leaves the slice and the router, then stops.
        victim = sorted(pods)[0]
        victim_pod = next(
            p
            for p in api.list(kube.POD, namespace, f"vsurge.io/model={MODEL}")
            if f"http://{p['status'].get('podIP')}:11556" == victim
        )
        ready = victim_pod["status"]
        ready["conditions"] = [
            {**c, "status": "False"} if c["type"] in ("Ready", "ContainersReady") else c
            for c in ready["conditions"]
        ]
        api.patch(
            kube.POD, namespace, victim_pod["metadata"]["name"], {"status": ready}, subresource="status"
        )
        wait_for(lambda: _upstreams(url) == 2, 30, message="the unready pod gone from the router's list")
        before = metric_value(
            _metrics(url), "vsurge_router_upstream_requests_total", upstream=victim, outcome="200"
        )
        servers[ips.index(_ip(victim))].proc.send_signal(signal.SIGTERM)
        work = bench.jobs(bench.system_prompts(4, 24, seed=501), 4, seed=6)
        results, _ = asyncio.run(bench.run(url, MODEL, work, concurrency=4, max_tokens=8))
        print(f"router pods: unready + SIGTERM cost {sum(not r.ok for r in results)} of {len(results)}")
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert (
            metric_value(
                _metrics(url), "vsurge_router_upstream_requests_total", upstream=victim, outcome="200"
            )
            == before
        )

        # Kill: one of the two left dies mid-run, still listed (no kubelet reports it): only streams that
        # had started on it may fail; everything else is retried on the last pod.
        target = sorted(pods)[1]
        proc = servers[ips.index(_ip(target))]
        info: dict = {}

        async def during(done: list) -> None:
            info.update(await bench.when_busy(target, done, 2, lambda: proc.proc.send_signal(signal.SIGKILL)))

        work = bench.jobs(bench.system_prompts(4, 24, seed=502), 6, seed=7)
        results, _ = asyncio.run(
            bench.run(
                url, MODEL, work, concurrency=4, max_tokens=8, stream=lambda j: j.user % 2 == 0, during=during
            )
        )
        failed = [r for r in results if not r.ok]
        print(f"router pods: kill cost {len(failed)} started stream(s) of {len(results)}; signalled {info}")
        assert info, "the pod was never seen busy"
        assert all(r.started and r.job.user % 2 == 0 for r in failed), [r.error for r in failed]
        assert len(failed) <= 4
    except BaseException:
        for router in routers:
            print(f"----- {router.log_path.name} -----\n{router.log()[-6000:]}")
        print(f"----- operator log -----\n{operator.log()[-3000:]}")
        raise
    finally:
        for router in routers:
            router.stop()
        operator.stop()
        kubelet.stop()
        for s in servers:
            s.stop()
