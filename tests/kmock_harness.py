"""What the operator and router suites share: KMock as the Kubernetes API on loopback, child processes, polling.

KMock 0.8 gaps covered here (see shared/DESIGN.md), never in the operator or the router:
- it stamps no uid/resourceVersion/generation/creationTimestamp -> ``StampingEmulator._handle`` adds them
  (the operator's owner references need the uid);
- every resource kopf touches must be declared -> ``declare_resources``;
- watched namespaces must exist as Namespace objects -> ``KMockCluster.add_namespace``;
- ``/api/v1/namespaces`` is mis-parsed as a namespace prefix -> ``fixed_parse_path`` wraps the parser;
- PUT is not supported -> rejected loudly with 405 so an accidental PUT fails the tests;
- labelSelector is ignored -> the operator filters labels itself (and the tests rely on that).
On top: ``faults`` injects API errors (e.g. a 500 on the first POST of a Deployment) before anything is
stored, to show that the operator and the router retry.

Both suites put tests/ on sys.path (tests/operator/conftest.py, tests/router/router_helpers.py), so this
module imports as ``kmock_harness`` whether the whole suite runs or one folder alone.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import kmock
import kubernetes
import yaml
from kmock._internal import parsing as kmock_parsing
from patience import ceiling, note_slow

from vsurge_operator import kube

REPO = Path(__file__).resolve().parents[1]
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


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies ``application/merge-patch+json``."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = apply_merge_patch(out.get(k), v)
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
                    new = apply_merge_patch(old, data)
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
    emulator.resources["v1/secrets"] = info(kind="Secret", singular="secret", namespaced=True, verbs=VERBS)
    emulator.resources["networking.k8s.io/v1/networkpolicies"] = info(
        kind="NetworkPolicy", singular="networkpolicy", namespaced=True, verbs=VERBS
    )
    emulator.resources["inference.networking.k8s.io/v1/inferencepools"] = info(
        kind="InferencePool", singular="inferencepool", namespaced=True, verbs=VERBS
    )
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
        if not self._ready.wait(ceiling(15)):
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

    def api_client(self) -> kubernetes.client.ApiClient:
        """A bare ApiClient pointed at KMock (what a kubeconfig would give the operator or the router)."""
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        return kubernetes.client.ApiClient(configuration)

    def client(self) -> kube.Kube:
        """A test-side API client (plays kubectl); same REST layer as the operator, separate config."""
        api_client = self.api_client()
        api_client.user_agent = TEST_AGENT
        return kube.Kube(api_client, timeout=10)


# ------------------------------------------------------------------------------------- processes, polling


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 15,
    interval: float = 0.05,
    message: str = "",
    exact: bool = False,
) -> Any:
    """Poll until ``predicate`` returns something truthy; return it, or fail with ``message``. ``timeout``
    is what an idle machine needs: the wait gives up at ``patience.ceiling(timeout)`` (``exact``: at
    ``timeout``, for a try that a caller repeats)."""
    start = time.monotonic()
    limit = timeout if exact else ceiling(timeout)
    last: Any = None
    while time.monotonic() < start + limit:
        last = predicate()
        if last:
            note_slow(time.monotonic() - start, timeout, message)
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {limit:g}s: {message} (last: {last!r})")


class LoggedProcess:
    """A child process logged to a file, stopped with SIGTERM (then SIGKILL) by ``stop()``."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.args = args
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LoggedProcess:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args, env=self.env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT
        )
        return self

    def wait_http(self, url: str, timeout: float) -> None:
        """Until GET ``url`` answers 200 (``timeout``: on an idle machine, see patience.py); fails early,
        with the log, if the process dies."""
        start = time.monotonic()
        deadline = start + ceiling(timeout)
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.args[:3]} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(url, timeout=10).status_code == 200:
                    note_slow(time.monotonic() - start, timeout, url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{url} not ready in {ceiling(timeout):g}s:\n{self.log()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

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


# ------------------------------------------------------------------------------------- subprocesses


def vsurge_command() -> list[str]:
    """The installed `vsurge` console script (what users run), else the same entry point through Python."""
    script = Path(sys.executable).parent / "vsurge"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from vsurge.cli.main import main; sys.exit(main())"]


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without settings that would steer a child elsewhere (cluster, tracing)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KUBERNETES_", "OTEL_", "VSURGE_", "KUBECONFIG"))
    }
    env.update(extra)
    return env
