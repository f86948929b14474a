"""One reconcile pass and one autoscaler pass, in process, against KMock (no kopf): writes, events, spans."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from kmock_harness import Fault, KMockCluster
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from operator_harness import MetricsBoard, PodMetricsServer, condition, inference_model

from vsurge_operator import apply, kube, manifests, reconcile, scaling, spec, tracing
from vsurge_operator.config import OperatorConfig

IM = "vsurge.io/v1alpha1/inferencemodels"
WRITES = ("POST", "PATCH", "DELETE", "PUT")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure(exporter=exporter, set_global=False)
    try:
        yield exporter
    finally:
        tracing.shutdown()
        tracing._provider = None


class Events(list):
    def __call__(self, body: Any, type_: str, reason: str, message: str) -> None:
        self.append((type_, reason, message))

    def reasons(self) -> list[str]:
        return [r for _, r, _ in self]


def _create(cluster: KMockCluster, api: kube.Kube, namespace: str, **spec: Any) -> dict[str, Any]:
    """Create the InferenceModel ``m`` with ``spec``; return it as stored."""
    api.create(kube.INFERENCE_MODEL, namespace, inference_model("m", namespace, **spec))
    return cluster.obj(IM, namespace, "m")


def _reconciler(api: kube.Kube) -> tuple[reconcile.Reconciler, Events]:
    """A Reconciler on ``api``'s connection with the default config, and the Events it records."""
    events = Events()
    return reconcile.Reconciler(kube.Kube(api.api), OperatorConfig(), events), events


# Autoscaling between 1 and 5 replicas for an occupancy of 0.5.
AUTOSCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 5, "target": 0.5}


def _writes(cluster: KMockCluster) -> int:
    return len([r for r in cluster.requests() if str(getattr(r.method, "value", r.method)).upper() in WRITES])


def test_reconcile_creates_then_writes_nothing(cluster, namespace, api, spans):
    r, events = _reconciler(api)
    body = _create(cluster, api, namespace, tpu={"accelerator": "tpu-v6e-slice", "topology": "2x2"})
    out = r.reconcile(body)
    assert [(a.kind, a.action) for a in out.applied] == [
        ("Deployment", "created"),
        ("Service", "created"),
        ("PodDisruptionBudget", "created"),
    ]
    assert events.reasons() == ["Created", "Created", "Created"]
    assert out.status_patch and out.status_patch["workloadKind"] == "Deployment"

    # Second pass with the stored object: no write at all.
    writes = _writes(cluster)
    out = r.reconcile(cluster.obj(IM, namespace, "m"), trigger="timer")
    assert [a.action for a in out.applied] == ["unchanged"] * 3 and out.status_patch is None
    assert _writes(cluster) == writes
    assert len(events) == 3

    finished = spans.get_finished_spans()
    assert [s.name for s in finished] == ["vsurge.reconcile", "vsurge.reconcile"]
    assert finished[0].attributes["vsurge.model"] == "m"
    assert finished[0].attributes["vsurge.reconcile.changed"] is True
    assert finished[1].attributes["vsurge.reconcile.changed"] is False
    assert finished[1].attributes["vsurge.reconcile.trigger"] == "timer"


def test_invalid_spec_reports_once(cluster, namespace, api, spans):
    r, events = _reconciler(api)
    body = _create(cluster, api, namespace, engine={"maxLength": 512, "prefillLengths": [256, 1024]})
    out = r.reconcile(body)
    assert [e.field for e in out.errors] == ["spec.engine.prefillLengths"]
    assert events.reasons() == ["InvalidSpec"]
    stored = cluster.obj(IM, namespace, "m")
    assert condition(stored, "Degraded")["status"] == "True"
    out = r.reconcile(stored)
    assert out.status_patch is None and events.reasons() == ["InvalidSpec"]
    assert not cluster.objects("deployments", namespace)
    assert spans.get_finished_spans()[0].attributes["vsurge.reconcile.valid"] is False


def test_foreign_object_is_never_taken_over(cluster, namespace, api):
    api.create(
        kube.SERVICE,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "m", "namespace": namespace},
            "spec": {"ports": []},
        },
    )
    r, _ = _reconciler(api)
    body = _create(cluster, api, namespace)
    with pytest.raises(apply.OwnershipConflict):
        r.reconcile(body)
    assert cluster.obj("v1/services", namespace, "m")["spec"] == {"ports": []}


def test_api_failure_is_recorded(cluster, namespace, api, spans):
    r, events = _reconciler(api)
    body = _create(cluster, api, namespace)
    cluster.call(lambda: cluster.emulator.faults.append(Fault("POST", "deployments", 503)))
    with pytest.raises(kube.ApiException) as err:
        r.reconcile(body)
    assert kube.is_retriable(err.value)
    r.report_failure(body, err.value)
    assert events[-1][:2] == ("Warning", "ApiError") and "503" in events[-1][2]
    stored = cluster.obj(IM, namespace, "m")
    assert condition(stored, "Degraded")["reason"] == "ApiError"
    assert spans.get_finished_spans()[0].status.status_code.name == "ERROR"


def test_workload_kind_switch_removes_the_old_one(cluster, namespace, api):
    r, events = _reconciler(api)
    body = _create(cluster, api, namespace, tpu={"accelerator": "tpu-v5p-slice", "topology": "2x2x2"})
    r.reconcile(body)
    assert cluster.obj("leaderworkerset.x-k8s.io/v1/leaderworkersets", namespace, "m")
    api.patch(kube.INFERENCE_MODEL, namespace, "m", {"spec": {"tpu": {"topology": "2x2x1"}}})
    out = r.reconcile(cluster.obj(IM, namespace, "m"))
    # one host: no step lane (its NetworkPolicy goes; its Secret stays until the model does), no group budgets
    assert (
        out.removed == ["LeaderWorkerSet", "NetworkPolicy", "PodDisruptionBudget"]
        and events.reasons()[-1] == "Deleted"
    )
    assert cluster.obj("leaderworkerset.x-k8s.io/v1/leaderworkersets", namespace, "m") is None
    assert cluster.obj("apps/v1/deployments", namespace, "m")


def test_missing_leader_worker_set_api_is_explained(cluster, namespace, api):
    cluster.call(lambda: cluster.emulator.faults.append(Fault("POST", "leaderworkersets", 404)))
    r, _ = _reconciler(api)
    body = _create(cluster, api, namespace, tpu={"accelerator": "tpu-v5p-slice", "topology": "2x2x2"})
    with pytest.raises(reconcile.MissingApi, match="install LWS"):
        r.reconcile(body)


def _add_pod(api: kube.Kube, m: spec.ModelSpec, name: str, port: int) -> None:
    api.create(
        kube.POD,
        m.namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": m.namespace, "labels": manifests.labels(m)},
            "spec": {
                "containers": [
                    {"name": "server", "image": "i", "ports": [{"name": "metrics", "containerPort": port}]}
                ]
            },
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        },
    )


def test_autoscaler_step_scales_through_the_scale_subresource(cluster, namespace, api, spans):
    events = Events()
    body = _create(cluster, api, namespace, replicas=2, autoscaling=AUTOSCALING)
    m = spec.parse(body)
    board = MetricsBoard(occupancy=0.9, queue=1)
    servers = [PodMetricsServer(board, m.served_name, f"m-{i}") for i in range(2)]
    try:
        for i, s in enumerate(servers):
            _add_pod(api, m, f"m-{i}", s.port)
        # A pod of another model in the same namespace (label selectors are ignored by KMock).
        api.create(
            kube.POD,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "other", "namespace": namespace, "labels": {"vsurge.io/model": "other"}},
                "status": {"phase": "Running", "podIP": "127.0.0.1"},
            },
        )
        scaler = scaling.ModelAutoscaler(kube.Kube(api.api), OperatorConfig(), events)
        decision = asyncio.run(scaler.step(body, now=1000.0))
    finally:
        for s in servers:
            s.close()
    assert (decision.current, decision.replicas, decision.reason) == (2, 4, "ScaleUp")
    assert decision.value == pytest.approx(0.9)
    stored = cluster.obj(IM, namespace, "m")
    assert stored["spec"]["replicas"] == 4
    assert cluster.requests(method="PATCH", plural="inferencemodels", subresource="scale")
    assert stored["status"]["occupancy"] == 0.9 and stored["status"]["prefillQueue"] == 1
    assert (
        stored["status"]["autoscaler"]["reason"] == "ScaleUp"
        and "lastScaleTime" in stored["status"]["autoscaler"]
    )
    assert events[-1][:2] == ("Normal", "ScaledUp") and "2 -> 4" in events[-1][2]
    (s,) = spans.get_finished_spans()
    assert s.name == "vsurge.autoscale"
    assert s.attributes["vsurge.autoscale.desired_replicas"] == 4
    assert s.attributes["vsurge.autoscale.pods"] == 2
    assert scaler.history.events == ((1000.0, 2),)


def test_autoscaler_keeps_history_consistent_when_scaling_fails(cluster, namespace, api):
    body = _create(cluster, api, namespace, replicas=1, autoscaling=AUTOSCALING)
    m = spec.parse(body)
    board = MetricsBoard(occupancy=1.0)
    server = PodMetricsServer(board, m.served_name, "m-0")
    cluster.call(
        lambda: cluster.emulator.faults.append(Fault("PATCH", "inferencemodels", 500, subresource="scale"))
    )
    try:
        _add_pod(api, m, "m-0", server.port)
        scaler = scaling.ModelAutoscaler(kube.Kube(api.api), OperatorConfig(), Events())
        with pytest.raises(kube.ApiException):
            asyncio.run(scaler.step(body, now=10.0))
        assert scaler.history.events == () and scaler.history.recommendations
        assert cluster.obj(IM, namespace, "m")["spec"]["replicas"] == 1
        assert asyncio.run(scaler.step(body, now=20.0)).replicas == 2
    finally:
        server.close()


def test_autoscaler_ignores_models_without_autoscaling(cluster, namespace, api):
    body = _create(cluster, api, namespace, replicas=3)
    scaler = scaling.ModelAutoscaler(kube.Kube(api.api), OperatorConfig(), Events())
    assert asyncio.run(scaler.step(body)) is None  # no decision, no scaling
    assert not cluster.requests(plural="inferencemodels", subresource="scale")
    # what the engines run is read once per spec generation: with status.engine current, no pod is listed
    listed = len(cluster.requests(plural="pods"))
    body = {
        **body,
        "status": {"engine": {"driver": "vdriver", "generation": body["metadata"].get("generation")}},
    }
    assert asyncio.run(scaler.step(body)) is None
    assert len(cluster.requests(plural="pods")) == listed


def test_a_new_leader_continues_the_autoscalers_decisions_from_the_status(cluster, namespace, api):
    """Operator replica A watches the load fall for most of a scale-down window; B takes over and scales
    down when A would have, instead of waiting a whole new window as a memory-less start does."""
    body = _create(cluster, api, namespace, replicas=4, autoscaling=AUTOSCALING)  # window 300 s
    m = spec.parse(body)
    board = MetricsBoard(occupancy=0.1)
    servers = [PodMetricsServer(board, m.served_name, f"m-{i}") for i in range(4)]
    try:
        for i, s in enumerate(servers):
            _add_pod(api, m, f"m-{i}", s.port)
        a = scaling.ModelAutoscaler(kube.Kube(api.api), OperatorConfig(), Events())
        for t in (1000.0, 1100.0, 1200.0, 1290.0):
            d = asyncio.run(a.step(cluster.obj(IM, namespace, "m"), now=t))
            assert (d.replicas, d.reason) == (4, "ScaleDownStabilized")
        stored = cluster.obj(IM, namespace, "m")
        assert stored["status"]["autoscaler"]["history"]["recommendations"] == [[1000.0, 4], [1290.0, 1]]

        fresh = scaling.ModelAutoscaler(kube.Kube(api.api), OperatorConfig(), Events())
        blind = {**stored, "status": {}}  # what a replica without the stored history would do
        assert asyncio.run(fresh.step(blind, now=1301.0)).replicas == 4
        b = scaling.ModelAutoscaler(kube.Kube(api.api), OperatorConfig(), Events())
        d = asyncio.run(b.step(stored, now=1301.0))
    finally:
        for s in servers:
            s.close()
    assert (d.current, d.replicas, d.reason) == (4, 1, "ScaleDown")
    assert cluster.obj(IM, namespace, "m")["spec"]["replicas"] == 1


def test_status_engine_says_what_the_pods_run(cluster, namespace, api):
    # a model without autoscaling: its pods' vsurge_engine_info lands in status.engine, with the generation
    body = _create(cluster, api, namespace, replicas=1)
    m = spec.parse(body)
    server = PodMetricsServer(MetricsBoard(), m.served_name, "m-0")
    try:
        _add_pod(api, m, "m-0", server.port)
        scaler = scaling.ModelAutoscaler(kube.Kube(api.api), OperatorConfig(), Events())
        assert asyncio.run(scaler.step(body)) is None
        engine = cluster.obj(IM, namespace, "m")["status"]["engine"]
        assert engine == {
            "driver": "vdriver",
            "attention": "dense (flat rows)",
            "backend": "tpu",
            "decodeSteps": 4,
            "generation": body["metadata"].get("generation"),
        }
    finally:
        server.close()
