"""spec.compileCache for real: two starts of `vsurge serve`, as two pods of one model, share the claim.

The layout is the operator's: each pod has its own cache volume at VSURGE_CACHE_DIR, and the compile-cache
claim is mounted inside it at the path the pod spec names ($VSURGE_CACHE_DIR/jax, where `vsurge serve` keeps
JAX's persistent compilation cache). Here the claim is a folder both pods' mount paths lead to. The first
start compiles and writes the programs to the claim; the second start finds them there. Both starts'
`vsurge_compile_seconds` are printed (the closing note's numbers); the verdict rests on the cache files,
not on the clock.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from vsurge_operator import compile_cache, manifests, spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--max-length=64", "--prefill-lengths=16,32", "--max-concurrent-decodes=4"]


def _pod_layout() -> tuple[str, str]:
    """(VSURGE_CACHE_DIR, the compile-cache mount path) of a model pod with spec.compileCache."""
    body = {
        "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
        "spec": {"model": {"source": "default"}, "compileCache": {"size": "10Gi"}},
    }
    pod = manifests.workload(spec.parse(body, default_image="img"))["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == compile_cache.VOLUME]
    return env["VSURGE_CACHE_DIR"], mount


def _start(model_dir: Path, cache_dir: Path, log: Path):
    sys.path.insert(0, str(REPO / "tests"))
    from kmock_harness import LoggedProcess, clean_env, free_port, vsurge_command

    port, metrics_port = free_port(), free_port()
    # `vsurge serve` keeps its compile cache in $VSURGE_CACHE_DIR/jax and stores only programs that took 1 s
    # or more to compile, which would make the file count depend on this machine's speed. Naming that same
    # folder as JAX_COMPILATION_CACHE_DIR (the server then leaves JAX's settings alone) with a threshold of
    # 0 stores every program, so "found them all" is exact.
    env = clean_env(
        JAX_PLATFORMS="cpu",
        VSURGE_CACHE_DIR=str(cache_dir),
        JAX_COMPILATION_CACHE_DIR=str(cache_dir / "jax"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    env.pop("XLA_FLAGS", None)
    args = [
        *vsurge_command(),
        "serve",
        f"--model={model_dir}",
        "--served-model-name=m",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--metrics-port={metrics_port}",
        *FLAGS,
    ]
    proc = LoggedProcess(args, log, env).start()
    proc.wait_http(f"http://127.0.0.1:{port}/readiness", timeout=600)
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    proc.stop()
    (line,) = [ln for ln in metrics.splitlines() if ln.startswith("vsurge_compile_seconds{")]
    return float(line.split()[-1])


def _programs(claim: Path) -> set[str]:
    """The compiled programs in the cache (JAX writes NAME-KEY-cache, plus an -atime file for its LRU)."""
    return {f for f in os.listdir(claim) if f.endswith("-cache")}


def test_a_second_pod_finds_the_first_ones_compiled_programs(tmp_path):
    cache_env, mount = _pod_layout()
    assert mount == f"{cache_env}/jax"
    sys.path.insert(0, str(REPO / "tests" / "service"))
    from tiny_models import make_checkpoint

    model_dir = tmp_path / "tiny"
    make_checkpoint(model_dir, "llama", seed=0)
    claim = tmp_path / "claim"  # the PersistentVolumeClaim
    claim.mkdir()
    # Every pod sees its cache volume at the same path (VSURGE_CACHE_DIR) and the claim at the same path
    # inside it: JAX's cache keys include that path (jax_persistent_cache_enable_xla_caches puts
    # <cache dir>/xla_gpu_per_fusion_autotune_cache_dir into the compile options), so the test keeps it too.
    cache = tmp_path / "var-cache-vsurge"

    def new_pod() -> None:  # a fresh emptyDir at VSURGE_CACHE_DIR, the claim mounted in it
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()
        (cache / Path(mount).relative_to(cache_env)).symlink_to(claim, target_is_directory=True)

    new_pod()
    first = _start(model_dir, cache, tmp_path / "a.log")
    written = _programs(claim)
    new_pod()
    second = _start(model_dir, cache, tmp_path / "b.log")
    after = _programs(claim)
    new = after - written
    print(
        f"compile cache: first start {first:.1f} s compiling ({len(written)} programs written to the claim), "
        f"second start {second:.1f} s ({len(written) - len(new)} found, {len(new)} compiled anew)"
    )
    assert written, "the first pod wrote no compiled program to the claim"
    assert not new, f"the second pod compiled {len(new)} programs anew instead of loading them"
