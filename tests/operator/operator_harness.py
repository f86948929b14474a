"""Test harness: a KMock Kubernetes API on loopback, the real operator process, and a fake kubelet.

KMock 0.8 gaps covered here (see shared/DESIGN.md), never in the operator:
- it stamps no uid/resourceVersion/generation/creationTimestamp -> ``StampingEmulator._handle`` adds them
  (the operator's owner references need the uid);
- every resource kopf touches must be declared -> ``declare_resources``;
- watched namespaces must exist as Namespace objects -> ``KMockCluster.add_namespace``;
- ``/api/v1/namespaces`` is mis-parsed as a namespace prefix -> ``fixed_parse_path`` wraps the parser;
- PUT is not supported -> rejected loudly with 405 so an accidental PUT fails the tests;
- labelSelector is ignored -> the operator filters labels itself (and the tests rely on that).
On top: ``faults`` injects API errors (e.g. a 500 on the first POST of a Deployment) before anything is
stored, to show that the operator retries.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import kmock
import kubernetes
import yaml
from kmock._internal import parsing as kmock_parsing
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from vsurge_operator import kube

REPO = Path(__file__).resolve().parents[2]
TEST_AGENT = "vsurge-operator-tests"
VERBS = {"get", "list", "watch", "create", "patch", "delete"}


# --------------------------------------------------------------------------------------------- kmock


_original_parse_path = kmock_parsing.parse_path


def fixed_parse_path(path: str) -> kmock_parsing.ParsedPath:
    """``/api/v1/namespaces[/name]`` is the Namespace resource itself, not a namespace prefix."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return kmock_parsing.ParsedPath(
            group="", version="v1", plural="namespaces", name=parts[3] if len(parts) == 4 else None
        )
    return _original_parse_path(path)


@dataclass
class Fault:
    """Answer the next ``times`` matching requests with ``status`` instead of serving them."""

    method: str
    plural: str
    status: int
    times: int = 1
    subresource: str | None = None
    agent: str | None = None  # only requests whose User-Agent starts with this
    hits: int = 0


def _merge_patch_between(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns ``old`` into ``new``."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old or old[k] != v:
            patch[k] = _merge_patch_between(old.get(k), v)
    return patch


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


class StampingEmulator(kmock.KubernetesEmulator):
    """KubernetesEmulator plus the object metadata a real API server stamps, and fault injection."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.faults: list[Fault] = []
        self._rv = 0

    def _next_version(self) -> str:
        self._rv += 1
        return str(self._rv)

    async def _serve_list(self, request: Any) -> Any:
        # A real resourceVersion, so that the watch that follows can start from it.
        result = await super()._serve_list(request)
        result["metadata"]["resourceVersion"] = str(self._rv)
        return result

    async def _serve_watch(self, request: Any) -> Any:
        # KMock replays every existing object when a watch starts; a real API server only sends what
        # changed after the requested resourceVersion. Replays of older versions confuse kopf.
        since = request.params.get("resourceVersion", "")
        since_rv = int(since) if since.isdigit() else 0
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and since_rv:
                rv = str(event.get("object", {}).get("metadata", {}).get("resourceVersion", "0"))
                if rv.isdigit() and int(rv) <= since_rv:
                    continue
            yield event

    def _fault_for(self, request: Any) -> Fault | None:
        if request.resource is None:
            return None
        for f in self.faults:
            if (
                f.hits < f.times
                and f.method == str(getattr(request.method, "value", request.method)).upper()
                and f.plural == request.resource.plural
                and f.subresource == request.subresource
                and (f.agent is None or request.headers.get("User-Agent", "").startswith(f.agent))
            ):
                f.hits += 1
                return f
        return None

    async def _handle(self, request: Any) -> Any:
        method = str(getattr(request.method, "value", request.method)).upper()
        if method == "PUT":
            raise kmock.KubernetesError(
                status=405, reason="MethodNotAllowed", message="PUT is not allowed; PATCH"
            )
        fault = self._fault_for(request)
        if fault is not None:
            raise kmock.KubernetesError(
                status=fault.status, reason="InjectedFault", message=f"injected {fault.status} for {method}"
            )
        if request.resource is not None and request.action is not None:
            action = request.action
            if action == kmock.action.CREATE and isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:8]}"
                if request.namespace and not meta.get("namespace"):
                    meta["namespace"] = request.namespace
                meta["uid"] = str(uuid.uuid4())
                meta["resourceVersion"] = self._next_version()
                meta["generation"] = 1
                meta["creationTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            elif action == kmock.action.UPDATE:
                key = (request.resource, request.namespace, request.name)
                async with self._lock:
                    try:
                        current = self._objects[key]
                    except KeyError:
                        current = None
                    old = current.raw if current is not None and not current.deleted else None
                data = request.data
                if isinstance(data, list):
                    # kopf adds finalizers with a JSON patch guarded by a resourceVersion test: apply it
                    # here and hand KMock the equivalent merge patch.
                    if old is None:
                        raise kmock.KubernetesError(status=404, reason="NotFound", message="no such object")
                    try:
                        new_obj = jsonpatch.apply_patch(old, data)
                    except jsonpatch.JsonPatchTestFailed as e:
                        raise kmock.KubernetesError(status=409, reason="Conflict", message=str(e)) from e
                    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                        raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
                    data = _merge_patch_between(old, new_obj)
                    # KMock finds reactions by request identity, so the (frozen) request is edited in place.
                    object.__setattr__(request, "data", data)
                if not isinstance(data, dict):
                    raise kmock.KubernetesError(
                        status=415, reason="UnsupportedMediaType", message="unknown patch"
                    )
                meta = data.setdefault("metadata", {})
                for immutable in ("uid", "creationTimestamp", "generation"):
                    meta.pop(immutable, None)
                meta["resourceVersion"] = self._next_version()
                if old is not None and request.subresource != "status":
                    new = _merge(old, data)
                    generation = int(old.get("metadata", {}).get("generation") or 1)
                    if new.get("spec") != old.get("spec"):
                        generation += 1
                    meta["generation"] = generation
        return await super()._handle(request)


def declare_resources(emulator: kmock.KubernetesEmulator) -> None:
    info = kmock.ResourceInfo
    emulator.resources["v1/namespaces"] = info(
        kind="Namespace", singular="namespace", namespaced=False, verbs=VERBS
    )
    emulator.resources["v1/pods"] = info(kind="Pod", singular="pod", namespaced=True, verbs=VERBS)
    emulator.resources["v1/services"] = info(kind="Service", singular="service", namespaced=True, verbs=VERBS)
    emulator.resources["v1/events"] = info(kind="Event", singular="event", namespaced=True, verbs=VERBS)
    emulator.resources["apps/v1/deployments"] = info(
        kind="Deployment",
        singular="deployment",
        namespaced=True,
        verbs=VERBS,
        subresources={"status", "scale"},
    )
    emulator.resources["policy/v1/poddisruptionbudgets"] = info(
        kind="PodDisruptionBudget", singular="poddisruptionbudget", namespaced=True, verbs=VERBS
    )
    emulator.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = info(
        kind="LeaderWorkerSet",
        singular="leaderworkerset",
        namespaced=True,
        verbs=VERBS,
        subresources={"status", "scale"},
    )
    emulator.resources["vsurge.io/v1alpha1/inferencemodels"] = info(
        kind="InferenceModel",
        singular="inferencemodel",
        namespaced=True,
        verbs=VERBS,
        shortnames={"im"},
        subresources={"status", "scale"},
    )


class KMockCluster:
    """A StampingEmulator served on 127.0.0.1 from a background event loop."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.emulator: StampingEmulator | None = None
        self.port = 0

    # lifecycle
    def start(self) -> KMockCluster:
        self._thread.start()
        if not self._ready.wait(15):
            raise RuntimeError("kmock did not start")
        if self._error:
            raise self._error
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with StampingEmulator() as emulator, kmock.Server(emulator) as server:
            declare_resources(emulator)
            self.emulator = emulator
            self.port = server.port
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # access to the stored state, always from the emulator's loop
    def call(self, fn: Callable[[], Any]) -> Any:
        assert self._loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def add_namespace(self, name: str) -> None:
        assert self.emulator is not None
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "uid": str(uuid.uuid4())}}
        self.call(lambda: self.emulator.objects.__setitem__(("v1/namespaces", None, name), body))

    def obj(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The current stored object, or None if absent or deleted."""

        def read() -> dict[str, Any] | None:
            try:
                o = self.emulator.objects[resource, namespace, name]
            except KeyError:
                return None
            return None if o.deleted else copy.deepcopy(o.raw)

        return self.call(read)

    def history(self, resource: str, namespace: str, name: str) -> list[dict[str, Any] | None]:
        """Every stored version, None marking a deletion."""

        def read() -> list[dict[str, Any] | None]:
            try:
                o = self.emulator.objects[resource, namespace, name]
            except KeyError:
                return []
            return [None if v is None else copy.deepcopy(dict(v.raw)) for v in o.history]

        return self.call(read)

    def objects(self, plural: str, namespace: str) -> list[dict[str, Any]]:
        def read() -> list[dict[str, Any]]:
            return [
                copy.deepcopy(o.raw)
                for (res, ns, _), o in self.emulator.objects.items()
                if res.plural == plural and ns == namespace and not o.deleted
            ]

        return self.call(read)

    def requests(
        self,
        method: str | None = None,
        plural: str | None = None,
        subresource: Any = ...,
        namespace: str | None = None,
        agent: str | None = None,
    ) -> list[Any]:
        """Requests served so far; ``agent`` filters by User-Agent prefix (e.g. kube.USER_AGENT)."""

        def read() -> list[Any]:
            out = []
            for r in list(self.emulator):  # a KMock view iterates over the requests it saw
                if agent is not None and not r.headers.get("User-Agent", "").startswith(agent):
                    continue
                m = str(getattr(r.method, "value", r.method)).upper()
                if method is not None and m != method.upper():
                    continue
                if plural is not None and (r.resource is None or r.resource.plural != plural):
                    continue
                if subresource is not ... and r.subresource != subresource:
                    continue
                if namespace is not None and r.namespace != namespace:
                    continue
                out.append(r)
            return out

        return self.call(read)

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
            "contexts": [
                {"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}
            ],
            "current-context": "kmock",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def client(self) -> kube.Kube:
        """A test-side API client (plays kubectl); same REST layer as the operator, separate config."""
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        api_client = kubernetes.client.ApiClient(configuration)
        api_client.user_agent = TEST_AGENT
        return kube.Kube(api_client, timeout=10)


# ------------------------------------------------------------------------------------------ operator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    """``python -m vsurge_operator`` in a subprocess, logged to a file, stopped with SIGTERM."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        args: list[str],
        *,
        kopf_run: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.health_port = free_port()
        self.args = args
        self.kopf_run = (
            kopf_run  # `kopf run -m vsurge_operator.kopf_app` instead of `python -m vsurge_operator`
        )
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("KUBERNETES_", "OTEL_", "VSURGE_OPERATOR_"))
        }
        env["KUBECONFIG"] = str(self.kubeconfig)
        paths = [str(REPO / "operator"), str(REPO / "service"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env.update(self.extra_env)
        entry = ["kopf", "run", "-m", "vsurge_operator.kopf_app"] if self.kopf_run else ["vsurge_operator"]
        cmd = [
            sys.executable,
            "-m",
            *entry,
            "--standalone",
            "--verbose",
            f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
            *self.args,
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"operator not healthy in {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""


# ------------------------------------------------------------------------------------------- kubelet


@dataclass
class MetricsBoard:
    """What every fake pod reports; the test moves these numbers."""

    occupancy: float = 0.0
    queue: float = 0.0
    silent: set[str] = field(default_factory=set)  # pod names that report nothing


class _MetricsCollector:
    def __init__(self, board: MetricsBoard, model: str, pod: str) -> None:
        self.board, self.model, self.pod = board, model, pod

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.pod in self.board.silent:
            return
        occ = GaugeMetricFamily("vsurge_slot_occupancy", "Fraction of decode slots in use", labels=["model"])
        occ.add_metric([self.model], self.board.occupancy)
        queue = GaugeMetricFamily(
            "vsurge_prefill_queue_size", "Requests waiting for prefill", labels=["model"]
        )
        queue.add_metric([self.model], self.board.queue)
        yield occ
        yield queue


class PodMetricsServer:
    """A real HTTP server on loopback exposing one pod's /metrics in the Prometheus text format."""

    def __init__(self, board: MetricsBoard, model: str, pod: str) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_MetricsCollector(board, model, pod))

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                payload = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeKubelet:
    """Plays the Deployment controller and the kubelet for one namespace.

    Every ``tick`` seconds it makes each Deployment's pod count match ``spec.replicas`` (pods are created
    through the API, each backed by a real metrics server whose port is the pod's ``metrics`` port), and
    reports the counts in the Deployment's status, all through the API like the real controllers.
    """

    def __init__(self, api: kube.Kube, namespace: str, board: MetricsBoard, tick: float = 0.1) -> None:
        self.api, self.namespace, self.board, self.tick = api, namespace, board, tick
        self.servers: dict[str, PodMetricsServer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self.errors: list[BaseException] = []

    def start(self) -> FakeKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for server in self.servers.values():
            server.close()
        self.servers.clear()

    def _loop(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.sync()
            except Exception as e:  # kept for the test to inspect; the loop must go on
                self.errors.append(e)

    def sync(self) -> None:
        for dep in self.api.list(kube.DEPLOYMENT, self.namespace):
            name = dep["metadata"]["name"]
            want = int(dep.get("spec", {}).get("replicas") or 0)
            template = dep["spec"]["template"]
            model = next(
                (
                    e["value"]
                    for e in template["spec"]["containers"][0].get("env", [])
                    if e["name"] == "VSURGE_SERVED_MODEL_NAME"
                ),
                name,
            )
            mine = sorted(p for p in self.servers if p.startswith(f"{name}-pod-"))
            for i in range(len(mine), want):
                self._add_pod(dep, f"{name}-pod-{i}", template, model)
            for pod in mine[want:]:
                self.api.delete(kube.POD, self.namespace, pod)
                self.servers.pop(pod).close()
            count = len([p for p in self.servers if p.startswith(f"{name}-pod-")])
            self.api.patch(
                kube.DEPLOYMENT,
                self.namespace,
                name,
                {
                    "status": {
                        "observedGeneration": dep["metadata"].get("generation", 1),
                        "replicas": count,
                        "readyReplicas": count,
                        "updatedReplicas": count,
                        "availableReplicas": count,
                    }
                },
                subresource="status",
            )

    def _add_pod(self, dep: dict[str, Any], pod: str, template: dict[str, Any], model: str) -> None:
        server = PodMetricsServer(self.board, model, pod)
        self.servers[pod] = server
        container = template["spec"]["containers"][0]
        self.api.create(
            kube.POD,
            self.namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod,
                    "namespace": self.namespace,
                    "labels": dict(template["metadata"]["labels"]),
                },
                "spec": {
                    "containers": [
                        {
                            "name": container["name"],
                            "image": container["image"],
                            "ports": [
                                {"name": "http", "containerPort": 11556},
                                {"name": "metrics", "containerPort": server.port},
                            ],
                        }
                    ]
                },
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            },
        )


# ------------------------------------------------------------------------------------------- helpers


def wait_for(
    predicate: Callable[[], Any], timeout: float = 15, interval: float = 0.05, message: str = ""
) -> Any:
    """Poll until ``predicate`` returns something truthy; return it, or fail with ``message``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s: {message} (last: {last!r})")


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return {}


def inference_model(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    body_spec: dict[str, Any] = {
        "model": {"source": "default"},
        "image": "ghcr.io/vsurge-stack/vsurge-service:test",
    }
    body_spec.update(spec)
    return {
        "apiVersion": "vsurge.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body_spec,
    }
