"""Fixtures of the operator suite: KMock on loopback, the operator process, the fake kubelet."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Until the project is pip-installed, import the operator from the source tree; tests/ holds kmock_harness,
# shared with the router suite.
_REPO = Path(__file__).resolve().parents[2]
for _extra in (str(_REPO / "operator"), str(_REPO / "tests")):
    if _extra not in sys.path:
        sys.path.insert(0, _extra)

from kmock_harness import KMockCluster, fixed_parse_path  # noqa: E402
from operator_harness import FakeKubelet, MetricsBoard, OperatorProcess, inference_model  # noqa: E402

from vsurge_operator import kube  # noqa: E402


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[KMockCluster]:
    from kmock._internal import parsing

    monkeypatch.setattr(parsing, "parse_path", fixed_parse_path)
    c = KMockCluster().start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def namespace(cluster: KMockCluster) -> str:
    cluster.add_namespace("models")
    return "models"


@pytest.fixture
def api(cluster: KMockCluster) -> kube.Kube:
    """The test's own API client (it plays kubectl)."""
    return cluster.client()


@pytest.fixture
def create_model(api: kube.Kube, namespace: str) -> Callable[..., dict[str, Any]]:
    """``create_model(name, **spec)``: create ``inference_model(name, namespace, **spec)`` through ``api``."""

    def create(name: str, **spec: Any) -> dict[str, Any]:
        return api.create(kube.INFERENCE_MODEL, namespace, inference_model(name, namespace, **spec))

    return create


@pytest.fixture
def start_operator(cluster: KMockCluster, namespace: str, tmp_path: Path, request: pytest.FixtureRequest):
    """Start ``python -m vsurge_operator`` against KMock; always stopped (and its log shown on failure)."""
    procs: list[OperatorProcess] = []

    def start(*extra: str, resync: float = 1.0, retry: float = 0.3) -> OperatorProcess:
        kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
        args = [
            f"--namespace={namespace}",
            f"--resync-seconds={resync}",
            f"--retry-delay-seconds={retry}",
            *extra,
        ]
        proc = OperatorProcess(kubeconfig, tmp_path / f"operator-{len(procs)}.log", args)
        procs.append(proc)
        return proc.start()

    try:
        yield start
    finally:
        for proc in procs:
            proc.stop()
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            for proc in procs:
                print(f"----- operator log ({proc.log_path.name}) -----\n{proc.log()}")


@pytest.fixture
def board() -> MetricsBoard:
    return MetricsBoard()


@pytest.fixture
def kubelet(cluster: KMockCluster, namespace: str, board: MetricsBoard) -> Iterator[FakeKubelet]:
    k = FakeKubelet(cluster.client(), namespace, board).start()
    try:
        yield k
    finally:
        k.stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # Expose the call-phase report to fixtures, so that they can dump logs of failed tests only.
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report
