"""The cluster suite: the operator, the router and the chart against real Kubernetes API servers.

``../shared/k8s`` (beside the repository; ``K8SKIT_HOME`` overrides) starts etcd, kube-apiserver 1.20,
apiextensions-apiserver 0.36 (CRDs with CEL) and kube-controller-manager on loopback. One cluster per
session: ``up`` into a temporary folder with the InferenceModel CRD and the kit's LeaderWorkerSet CRD,
``down`` in ``finally`` (and ``--owner-pid`` stops it should pytest be killed). Every test here carries the
``cluster`` marker; without the kit they are skipped, and the reason is printed at the end of the run (under
``CI=true`` they fail instead: tests/needs_kit.py).
The kit folder is only read: its binaries are unpacked into ``K8SKIT_BIN_DIR`` (a temp folder by default).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# The operator from the source tree; tests/ (kmock_harness: child processes, ports), tests/operator (the KMock
# suite's spec cases, replayed here against the real server) and this folder (clusterkit).
for _extra in (str(REPO / "operator"), str(REPO / "tests"), str(REPO / "tests" / "operator"), str(HERE)):
    if _extra not in sys.path:
        sys.path.insert(0, _extra)

from clusterkit import KIT  # noqa: E402 - after the sys.path lines above
from needs_kit import missing, skip_or_fail  # noqa: E402

CRD_FILE = REPO / "helm" / "vsurge" / "crds" / "inferencemodels.vsurge.io.yaml"
LWS_CRD_FILE = KIT / "crds" / "leaderworkersets.leaderworkerset.x-k8s.io.yaml"


def _opted_out() -> bool:
    return os.environ.get("K8SKIT") == "0"


def skip_reason() -> str | None:
    """Why the cluster tests cannot run here, or None when they can."""
    if _opted_out():
        return "K8SKIT=0 is set"
    if not (KIT / "up").exists():
        return f"no Kubernetes test kit at {KIT} (../shared/k8s beside the repository, or K8SKIT_HOME)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = skip_reason()
    for item in items:
        if not _in_cluster_suite(item):
            continue
        item.add_marker(pytest.mark.cluster)
        # boots etcd + kube-apiserver + controllers: make test-fast skips it
        item.add_marker(pytest.mark.slow)
        if reason:
            why = f"cluster test needs the kit: {reason}"
            # K8SKIT=0 is a choice, said on the command line: skipped even under CI=true
            item.add_marker(pytest.mark.skip(reason=why) if _opted_out() else missing(why))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    skipped = [
        r
        for r in terminalreporter.stats.get("skipped", [])
        if "cluster test needs the kit" in str(r.longrepr)
    ]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} cluster tests skipped: {skip_reason()}", yellow=True)


# Session resources are released as soon as the last cluster test is done, not at the end of `make test`:
# the cluster (~630 MB) and the tiny server (which holds ports 11556/11557 of its IP) would otherwise stay
# up while the other suites run.
_after_last_cluster_test: list[Callable[[], Any]] = []


def _in_cluster_suite(item: pytest.Item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if not _in_cluster_suite(item) or not _after_last_cluster_test:
        return
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    if not any(_in_cluster_suite(i) for i in later):
        while _after_last_cluster_test:
            _after_last_cluster_test.pop()()


# ------------------------------------------------------------------------------------------- cluster


def _read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value.strip('"')
    return env


@dataclass
class Cluster:
    """One running k8skit cluster: its folder, env file, admin kubeconfig and clients."""

    dir: Path
    env: dict[str, str]
    startup_s: float
    _clients: dict[str, Any] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return Path(self.env["KUBECONFIG"])

    @property
    def server(self) -> str:
        return self.env["K8SKIT_API_SERVER"]

    @property
    def ca(self) -> str:
        return self.env["K8SKIT_CA"]

    def api_client(self) -> Any:
        """An admin (system:masters) ApiClient of the official client."""
        import kubernetes

        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    def kube(self, api_client: Any = None) -> Any:
        """Plain-dict REST over an ApiClient (admin by default): the test plays kubectl with it."""
        from vsurge_operator import kube

        return kube.Kube(api_client or self.api_client(), timeout=20)

    def token_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        """A kubeconfig that logs in with a bearer token (a ServiceAccount's), like a pod would."""
        import yaml

        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "k8skit",
                            "cluster": {"server": self.server, "certificate-authority": self.ca},
                        }
                    ],
                    "users": [{"name": "sa", "user": {"token": token}}],
                    "contexts": [
                        {"name": "sa", "context": {"cluster": "k8skit", "user": "sa", "namespace": namespace}}
                    ],
                    "current-context": "sa",
                }
            )
        )
        return path

    def log_tail(self, component: str, chars: int = 4000) -> str:
        try:
            return (self.dir / "logs" / f"{component}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@pytest.fixture(scope="session")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = skip_reason()
    if reason:  # only reached when a test outside tests/cluster asks for the fixture
        if _opted_out():
            pytest.skip(reason)
        skip_or_fail(reason)
    run_dir = tmp_path_factory.mktemp("k8s")
    bin_dir = os.environ.get("K8SKIT_BIN_DIR") or os.path.join(tempfile.gettempdir(), "k8skit-bin")
    cmd = [str(KIT / "up"), str(run_dir), "--owner-pid", str(os.getpid()), "--quiet"]
    for crd in (CRD_FILE, LWS_CRD_FILE):  # applied and served (CEL, defaults) before `up` returns
        cmd += ["--crd", str(crd)]
    started = time.monotonic()
    try:
        # `up` installs etcd (Debian etcd-server) with apt-get when it is missing and we are root.
        subprocess.run(
            cmd,
            check=True,
            timeout=300,
            env={
                **os.environ,
                "K8SKIT_BIN_DIR": bin_dir,
                # As on OpenShift and hardened clusters: setting blockOwnerDeletion needs update on the
                # owner's finalizers (the operator sets it on everything it creates).
                "K8SKIT_APISERVER_ARGS": " ".join(
                    a
                    for a in (
                        "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                        os.environ.get("K8SKIT_APISERVER_ARGS", ""),
                    )
                    if a
                ),
            },
            capture_output=True,
            text=True,
        )
        env = _read_env(run_dir / "env")
        _after_last_cluster_test.append(
            lambda: subprocess.run(
                [str(KIT / "down"), str(run_dir)], check=False, timeout=120, capture_output=True
            )
        )
        yield Cluster(run_dir, env, time.monotonic() - started)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"k8skit up failed ({e.returncode}):\n{e.stdout[-3000:]}\n{e.stderr[-6000:]}")
    finally:
        subprocess.run([str(KIT / "down"), str(run_dir)], check=False, timeout=120, capture_output=True)


@pytest.fixture
def namespace(k8s: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting for its contents to go)."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-")
    name = f"t-{base}-{os.urandom(2).hex()}"
    api = k8s.kube()
    api.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    yield name
    try:
        api.request("DELETE", f"/api/v1/namespaces/{name}")
    except Exception:
        pass


# ------------------------------------------------------------------------------ a real `vsurge serve`

# The router e2e suite's engine shapes (same architecture and flags), so the JAX compilation cache is shared.
TINY_FLAGS = ["--max-length=64", "--prefill-lengths=16,32", "--max-concurrent-decodes=4"]


@dataclass
class TinyServer:
    """One `vsurge serve` of a tiny random Llama on ``ip``:11556 (API) and ``ip``:11557 (/metrics)."""

    ip: str
    served_name: str
    proc: Any

    @property
    def url(self) -> str:
        return f"http://{self.ip}:11556"


_tiny: dict[str, Any] = {}


def _ports_free(ip: str) -> bool:
    import socket

    for port in (11556, 11557):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((ip, port))
            except OSError:
                return False
    return True


def _start_tiny(root: Path, ip: str | None = None) -> None:
    from clusterkit import clean_env, next_pod_ip, vsurge_command
    from kmock_harness import LoggedProcess

    ip = ip or next_pod_ip()
    _tiny["root"] = root
    model_dir = root / "tiny"
    # The checkpoint is written by the child (torch is slow to import), then it becomes `vsurge serve`.
    script = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); from tiny_models import make_checkpoint; "
        "make_checkpoint(sys.argv[2], 'llama', seed=0); os.execv(sys.argv[3], sys.argv[3:])"
    )
    serve = [
        *vsurge_command(),
        "serve",
        f"--model={model_dir}",
        "--served-model-name=auto",
        f"--host={ip}",
        "--port=11556",
        "--metrics-port=11557",
        *TINY_FLAGS,
    ]
    env = clean_env(JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device per server, not the suite's eight fake ones
    cmd = [sys.executable, "-c", script, str(REPO / "tests" / "service"), str(model_dir), *serve]
    _tiny["server"] = TinyServer(ip, "auto", LoggedProcess(cmd, root / "tiny-serve.log", env).start())


@pytest.fixture(scope="session", autouse=True)
def _prestart_tiny_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    # Compiling the tiny model takes 20-60 s on two cores: start it before the first test when a collected
    # test needs it, so that the compilation overlaps with the cluster's start and the earlier tests.
    wanted = any("tiny_server" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if wanted and not skip_reason():
        _start_tiny(tmp_path_factory.mktemp("tiny"))
        _after_last_cluster_test.append(_stop_tiny)
    try:
        yield
    finally:
        _stop_tiny()


def _stop_tiny() -> None:
    if "server" in _tiny:
        _tiny.pop("server").proc.stop()


@pytest.fixture
def tiny_server() -> TinyServer:
    server = _tiny.get("server")
    assert server is not None, "the tiny server was not started (see _prestart_tiny_server)"
    deadline = time.monotonic() + 300
    while True:
        try:
            server.proc.wait_http(f"{server.url}/readiness", timeout=max(1, deadline - time.monotonic()))
            return server
        except AssertionError as e:
            # The pod ports are fixed (11556/11557, as in the operator's pod spec): a `vsurge serve` of
            # someone else on 0.0.0.0 holds them on every IP. Wait for it to go, loudly, then start again.
            if "Address already in use" not in str(e) or time.monotonic() > deadline:
                raise
            print(f"ports 11556/11557 of {server.ip} are taken (a vsurge serve on 0.0.0.0?); waiting")
            while not _ports_free(server.ip):
                assert time.monotonic() < deadline, f"ports 11556/11557 of {server.ip} stayed taken"
                time.sleep(1)
            _start_tiny(_tiny["root"], server.ip)
            server = _tiny["server"]
