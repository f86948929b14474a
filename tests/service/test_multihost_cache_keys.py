"""A CPU group's workers read the compiled programs its leader wrote to the persistent cache
(vsurge.multihost.cpu_cache_keys): two real JAX processes on loopback join through `group.join`, run one
program over both processes' devices, twice; the second time every process finds it in the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from multihost_group import free_port

PROCESS = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from vsurge.multihost.group import ProcessGroup, join

    address, pid, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    join(ProcessGroup(address, 2, pid, "options", 60))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
    mesh = Mesh(np.array(jax.devices()), ("x",))
    x = jax.make_array_from_callback(
        (8,), NamedSharding(mesh, P("x")), lambda index: np.arange(8.0, dtype=np.float32)[index]
    )
    total = jax.jit(lambda a: (a * 3.0).sum(), out_shardings=NamedSharding(mesh, P()))(x)
    print(json.dumps({"hits": len(hits), "total": float(total.addressable_data(0))}))
    """
)


def _run_group(cache) -> list[dict]:
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, address, str(pid), str(cache)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    out = []
    for pid, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"process {pid} exited {p.returncode}:\n{stderr[-3000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_workers_read_the_programs_the_leader_wrote(tmp_path):
    cache = tmp_path / "jax-cache"
    first = _run_group(cache)
    second = _run_group(cache)
    want = 3.0 * sum(range(8))
    assert [r["total"] for r in first + second] == [want] * 4
    # a cold cache: the leader compiles and writes; the worker compiles too, unless the leader's entry is
    # already there when it looks (a loaded machine: the worker's process started later), then reads it
    assert first[0]["hits"] == 0 and first[1]["hits"] in (0, 1), first
    assert all(r["hits"] >= 1 for r in second), second  # the worker reads the leader's entry too
