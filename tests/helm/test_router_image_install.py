"""The router's lean image, installed the way docker/router.Dockerfile installs it, without Docker: into a
fresh venv, `pip install --require-hashes -r docker/locks/build.txt` and `-r docker/locks/router.txt`, then
`pip install --no-deps --no-build-isolation .`. The router then imports (its endpoint picker included),
`vsurge route --help` runs, and a real `vsurge route` on a static config answers /v1/models and /metrics;
none of JAX, the model libraries, the storage clients or kopf is installed.

It installs from the package index (every file checked against the lock's hashes): slow, marked so.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import venv
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
ABSENT = ("jax", "jaxlib", "flax", "transformers", "tokenizers", "safetensors", "huggingface-hub", "torch")
ABSENT += ("boto3", "google-cloud-storage", "llguidance", "numpy", "kopf")

PROBE = """
import importlib.metadata as md, json, sys
import vsurge.router.app, vsurge.router.cli, vsurge.router.extproc, vsurge.cli.main
installed = []
for name in sys.argv[1].split(","):
    try:
        md.distribution(name)
        installed.append(name)
    except md.PackageNotFoundError:
        pass
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"jax", "flax", "transformers", "numpy", "kopf"})
print(json.dumps({"installed": installed, "loaded": loaded, "file": vsurge.__file__}))
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def router_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("router-image")
    src = root / "src"  # what docker/router.Dockerfile.dockerignore sends
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("service", "operator", "docker/locks"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    venv.EnvBuilder(with_pip=True, clear=True).create(root / "venv")
    pip = [str(root / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for args in (
        ["--require-hashes", "-r", "docker/locks/build.txt"],
        ["--require-hashes", "-r", "docker/locks/router.txt"],
        ["--no-deps", "--no-build-isolation", "."],
    ):
        proc = subprocess.run(pip + args, cwd=src, capture_output=True, text=True, env=_env(), timeout=840)
        assert proc.returncode == 0, (
            f"pip install {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return root / "venv" / "bin"


def test_the_router_imports_with_only_its_lock(router_venv: Path) -> None:
    out = subprocess.run(
        [str(router_venv / "python"), "-c", PROBE, ",".join(ABSENT)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        cwd=router_venv,  # not the checkout: the venv's vsurge is what imports
    )
    assert out.returncode == 0, out.stderr[-4000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["installed"] == [] and found["loaded"] == [], found
    assert "site-packages" in found["file"] and str(REPO) not in found["file"], found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vsurge_route_starts_and_serves(router_venv: Path, tmp_path: Path) -> None:
    helped = subprocess.run(
        [str(router_venv / "vsurge"), "route", "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert helped.returncode == 0 and "--port" in helped.stdout, helped.stderr[-2000:]
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n  - name: llama\n    upstreams: [http://127.0.0.1:{_free_port()}]\n")
    port = _free_port()
    cmd = [str(router_venv / "vsurge"), "route", "--no-kubernetes", "--static-config", str(config)]
    proc = subprocess.Popen(
        cmd + ["--host", "127.0.0.1", "--port", str(port)],
        env=_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, models = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.3)
        assert models is not None and models.status_code == 200, proc.stdout.read() if proc.poll() else models
        assert "llama" in {m["id"] for m in models.json()["data"]}
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
