"""The operator's (and the router's) install is lean: `pip install .` (the core, what docker/operator.Dockerfile
installs) into a fresh virtual environment brings no JAX, no model libraries and no storage clients, and the
operator and the router still import and start their command lines there.

It installs from the package index (the CI machine reaches it) into a temporary venv: slow, marked so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
# Distributions that must not be installed, and modules that must not import.
HEAVY_DISTRIBUTIONS = (
    "jax",
    "jaxlib",
    "flax",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface-hub",
    "boto3",
    "google-cloud-storage",
    "llguidance",
    "torch",
)
HEAVY_MODULES = (
    "jax",
    "flax",
    "transformers",
    "boto3",
    "google.cloud.storage",
    "llguidance",
    "huggingface_hub",
)

PROBE = """
import importlib, importlib.metadata as md, json, sys
heavy_dists = sys.argv[1].split(",")
heavy_mods = sys.argv[2].split(",")
import vsurge_operator.__main__, vsurge_operator.handlers, vsurge_operator.reconcile, vsurge_operator.scaling
import vsurge.router.app, vsurge.router.cli
installed = []
for name in heavy_dists:
    try:
        md.distribution(name)
        installed.append(name)
    except md.PackageNotFoundError:
        pass
importable = []
for name in heavy_mods:
    try:
        importlib.import_module(name)
        importable.append(name)
    except ImportError:
        pass
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"jax", "flax", "transformers", "boto3", "numpy"})
print(json.dumps({"installed": installed, "importable": importable, "loaded": loaded}))
"""


@pytest.fixture(scope="module")
def lean_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lean")
    # A copy of what the operator image's build context holds (docker/operator.Dockerfile.dockerignore).
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("service", "operator"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=840,
    )
    assert proc.returncode == 0, f"pip install . failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return python


def _run(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Run from an empty folder so the checkout's sources are not what gets imported.
    return subprocess.run(
        [str(python), *args], capture_output=True, text=True, env=env, timeout=120, cwd=python.parent
    )


def test_operator_and_router_import_without_the_engine(lean_venv: Path) -> None:
    p = _run(lean_venv, "-c", PROBE, ",".join(HEAVY_DISTRIBUTIONS), ",".join(HEAVY_MODULES))
    assert p.returncode == 0, p.stderr[-4000:]
    found = json.loads(p.stdout.strip().splitlines()[-1])
    assert found == {"installed": [], "importable": [], "loaded": []}, found
    # The imports came from the venv, not from this checkout.
    where = _run(lean_venv, "-c", "import vsurge_operator; print(vsurge_operator.__file__)")
    assert "site-packages" in where.stdout and str(REPO) not in where.stdout, where.stdout


def test_operator_and_router_command_lines_start(lean_venv: Path) -> None:
    op = _run(lean_venv, "-m", "vsurge_operator", "--help")
    assert op.returncode == 0 and "--peering-lifetime" in op.stdout, op.stderr[-2000:]
    vsurge = lean_venv.parent / "vsurge"
    route = subprocess.run([str(vsurge), "route", "--help"], capture_output=True, text=True, timeout=120)
    assert route.returncode == 0 and "--port" in route.stdout, route.stderr[-2000:]
