"""Decode step time of one engine over 2 processes x 4 CPU devices (lockstep lane, gloo) against 1 process x 8
devices, same tiny model, same mesh (tp=8), run alternately in one invocation.

    python benchmarks/multihost_step.py --model DIR [--steps 30] [--rounds 2]

Each configuration runs in fresh processes: prefill + insert one prompt, a few warm-up steps, then
``--steps`` decode steps, each waited for (the token read every step, as the driver does). Prints ms/step per
round and the ratio group / single.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def _engine(model_dir: str, mesh):
    import vsurge

    model, tok = vsurge.load_model(model_dir, mesh=mesh)
    return model, tok, dict(max_concurrent_decodes=1, max_length=64, prefill_lengths=[32], mesh=mesh)


def _time_decode(engine, steps: int) -> float:
    import jax
    import numpy as np

    from vsurge.sampling_params import SamplingParams

    state = engine.init_decode_state()
    prefix = engine.prefill([5, 17, 42, 99, 7], SamplingParams(temperature=0.0, max_tokens=steps + 8))
    state, first = engine.insert(prefix, state, 0, length=5)
    for _ in range(3):
        state, out = engine.decode(state)
        np.asarray(out.tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out = engine.decode(state)
        np.asarray(out.tokens)  # a step is done when its token is on the host
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / steps * 1000


def child(args) -> None:
    from vsurge.models.sharding import make_mesh

    if args.role == "single":
        from vsurge.engines.vengine import vEngine

        mesh = make_mesh("tp=8")
        model, tok, kw = _engine(args.model, mesh)
        print(json.dumps({"ms": _time_decode(vEngine(model, tok, **kw), args.steps)}), flush=True)
        return
    from vsurge.distributed import ProcessGroup, join
    from vsurge.engine_config import EngineConfig
    from vsurge.engines import lockstep

    group = join(ProcessGroup(f"127.0.0.1:{args.port}", 2, int(args.role[-1]), "options", 120))
    mesh = make_mesh("tp=8")
    model, tok, kw = _engine(args.model, mesh)
    if group.is_leader:
        lane = lockstep.LeaderLane(group, host="127.0.0.1")
        lane.accept(120)
        config = EngineConfig(**kw, driver="vdriver")
        engine = lockstep.build_engine(model, tok, config)
        lane._send(("engine", lockstep.engine_setup(engine, config.replace(mesh=None))))
        proxy = lockstep.LeaderEngine(engine, lane)
        print(json.dumps({"ms": _time_decode(proxy, args.steps)}), flush=True)
        lane.close()
        os._exit(0)
    worker = lockstep.Worker(group, model, tok, mesh)
    worker.connect(120)
    worker.run()
    os._exit(0)


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue


def _run(args, role: str, devices: int, port: int = 0) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, __file__, "--child", role, "--model", args.model, "--steps", str(args.steps)]
    cmd += ["--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def _ms(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate(timeout=1800)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode not in (0, None) and not lines:
        raise SystemExit(f"a benchmark process failed ({proc.returncode})")
    return json.loads(lines[-1])["ms"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.child:
        args.role = args.child
        return child(args)
    rows = []
    for r in range(args.rounds):
        single = _ms(_run(args, "single", 8))
        port = _free_port()
        worker = _run(args, "group1", 4, port)
        leader = _run(args, "group0", 4, port)
        group = _ms(leader)
        worker.wait(timeout=120)
        rows.append((single, group))
        print(
            f"round {r}: 1 process x 8 devices {single:.1f} ms/step | 2 processes x 4 devices {group:.1f} ms/step"
        )
    s = sorted(x for x, _ in rows)[len(rows) // 2]
    g = sorted(y for _, y in rows)[len(rows) // 2]
    print(f"median: single {s:.1f} ms, group {g:.1f} ms, ratio group/single {g / s:.2f}")


if __name__ == "__main__":
    main()
