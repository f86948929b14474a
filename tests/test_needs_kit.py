"""A missing kit (``../shared/k8s``, ``../shared/seed``) skips the tests that need it, saying why; under
``CI=true`` it fails them (tests/needs_kit.py). Real pytest runs of the real cluster and seed test files, with
the kits' paths (``K8SKIT_HOME``, ``VSURGE_SEED_DOC``) pointed at a folder that does not exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ["tests/cluster/test_cluster_crd.py", "tests/service/test_seed_conformance.py"]
PYTEST = ["-m", "pytest", "-q", "-rsE", "-p", "no:randomly", "-p", "no:cacheprovider"]


def _run(tmp_path: Path, ci: bool) -> tuple[int, str, dict[str, int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "K8SKIT", "PYTEST_ADDOPTS")}
    env.update(K8SKIT_HOME=str(tmp_path / "no-k8s"), VSURGE_SEED_DOC=str(tmp_path / "no-seed" / "api.txt"))
    if ci:
        env["CI"] = "true"
    proc = subprocess.run(
        [sys.executable, *PYTEST, *FILES], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    last = out.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
    return proc.returncode, out, counts


def test_without_ci_a_missing_kit_skips_and_says_why(tmp_path):
    code, out, counts = _run(tmp_path, ci=False)
    assert code == 0, out[-4000:]
    assert set(counts) == {"skipped"} and counts["skipped"] > 5, out[-4000:]
    assert re.search(r"\d+ cluster tests skipped: no Kubernetes test kit at .*no-k8s", out), out[-4000:]
    assert re.search(r"\d+ seed conformance tests skipped: .*no seed document at .*no-seed", out), out[-4000:]


def test_under_ci_a_missing_kit_fails_every_test_that_needs_it(tmp_path):
    code, out, counts = _run(tmp_path, ci=True)
    assert code == 1, out[-4000:]
    errors = counts.get("errors", counts.get("error", 0))
    assert set(counts) <= {"error", "errors"} and errors > 5, out[-4000:]
    for kit in ("no Kubernetes test kit at", "no seed document at"):
        lines = [line for line in out.splitlines() if line.startswith("ERROR") and kit in line]
        assert lines and all("CI=true: a CI run must run these tests" in line for line in lines), out[-4000:]
