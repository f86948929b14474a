"""The multi-host step lane's cost: per call on its own, and per decode step of a real 2-process group.

    python benchmarks/multihost_step.py lane [--calls 2000] [--layers 2,32]
    python benchmarks/multihost_step.py steps --model DIR [--steps 30] [--rounds 2]

``lane``: what one engine call costs the lane alone, in one process over a loopback socket pair: the leader
encodes the call (its device arrays become handles, oDriver's page table a host value) and sends it, the
worker receives, checks and decodes it back into arrays. Three representative calls: vDriver's decode (the
decode state: handles only, 2 arrays per layer plus the sampler's rows), vDriver's insert (a prefix, the
state, a key), oDriver's mixed step (the state, a 32 x 128 page table by value, a chunk of 32 tokens).
It runs on either lane: this checkout's (authenticated frames, explicit format) or, with PYTHONPATH at a
checkout from before them (``vsurge/engines/lockstep.py``), the pickled one, so before and after compare.

``steps``: decode step time of one engine over 2 processes x 4 CPU devices (the lane, gloo) against
1 process x 8 devices, same tiny model, same mesh (tp=8), run alternately in one invocation: prefill +
insert one prompt, a few warm-up steps, then ``--steps`` decode steps, each waited for (the token read every
step, as the driver does). Prints ms/step per round and the ratio group / single.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time

# ------------------------------------------------------------------------------------ the lane alone


def _arrays(n: int, shape=(4,)):
    import jax.numpy as jnp

    return [jnp.zeros(shape, jnp.int32) + i for i in range(n)]


def _calls(layers: int):
    """(name, method path, args) of the three calls, built from real (small) device arrays."""
    import numpy as np

    from vsurge.engines.dense.mixed_step import Chunk
    from vsurge.engines.dense.vengine import GenerationState, Prefix
    from vsurge.engines.sampling import SlotSampling

    caches = tuple(tuple(_arrays(2)) for _ in range(layers))
    sampling = SlotSampling(*_arrays(len(SlotSampling._fields)))
    state = GenerationState(caches, *_arrays(5), sampling)
    prefix = Prefix(caches, *_arrays(4), sampling)
    key = np.array([1, 2], np.uint32)
    import jax

    table = jax.device_put(np.zeros((32, 128), np.int32))  # made by the driver: travels by value
    chunk = Chunk(3, 0, np.arange(32, dtype=np.int32))
    return [
        ("vdriver decode", "decode", (state,), {}),
        ("vdriver insert", "insert", (prefix, state, 1), {"key": key, "length": 9}),
        ("odriver step", "step", (state, table, np.ones(16, bool), [chunk]), {}),
    ]


def _new_lane(calls, n_calls: int) -> dict[str, float]:
    """This checkout's lane: wire.encode + Channel.send, Channel.recv + wire.decode."""
    import jax

    from vsurge.multihost import channel as ch
    from vsurge.multihost import wire
    from vsurge.multihost.engine_proxy import register_records
    from vsurge.multihost.handles import LeaderHandles, result_arrays

    register_records()
    a, b = socket.socketpair()
    secret = secrets.token_bytes(32)
    leader = ch.Channel(a, secret, secret[::-1], "w")
    worker = ch.Channel(b, secret[::-1], secret, "l")

    def call(path, args, kwargs):
        handles = LeaderHandles()
        handles.register(0, (args, kwargs))  # the arrays came from an earlier call: handles
        held = {(0, i): x for i, x in result_arrays((args, kwargs))}

        def one(n: int) -> None:
            payload = wire.encode((n, path, args, kwargs, handles.take_dead()), handles.ref)
            leader.send(ch.CALL, payload)
            _, got = worker.recv()
            wire.decode(got, lambda h: held[(h.call, h.leaf)], lambda v: jax.device_put(v.value))

        return one

    return {name: _timed(call(path, args, kwargs), n_calls) for name, path, args, kwargs in calls}


def _old_lane(calls, n_calls: int) -> dict[str, float]:
    """The pickled lane of vsurge/engines/lockstep.py (a checkout from before the authenticated one)."""
    import io

    from vsurge.engines import lockstep

    class Group:
        def lane_address(self):
            return "127.0.0.1", _free_port()

    a, b = socket.socketpair()
    out = {}
    for name, path, args, kwargs in calls:
        lane = lockstep.LeaderLane(Group(), host="127.0.0.1")
        lane._server.close()
        lane._register(0, (args, kwargs))

        class Worker:
            engine = type("E", (), {"mesh": None})()
            handles = {(0, i): x for i, x in lockstep._result_arrays((args, kwargs))}

        def one(n: int, lane=lane, Worker=Worker, path=path, args=args, kwargs=kwargs) -> None:
            buf = io.BytesIO()
            lockstep._Encoder(buf, lane).dump(("call", path, args, kwargs, lane._take_dead()))
            lockstep.send_frame(a, buf.getvalue())
            lockstep._Decoder(lockstep.recv_frame(b), Worker()).load()

        out[name] = _timed(one, n_calls)
    return out


def _timed(one, n: int, rounds: int = 5) -> float:
    """Microseconds per call: the best of ``rounds`` rounds of n / rounds calls (a shared machine's
    other work only ever adds time)."""
    for i in range(min(100, n)):
        one(i)
    best, per = float("inf"), max(1, n // rounds)
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(per):
            one(r * per + i)
        best = min(best, (time.perf_counter() - t0) / per)
    return best * 1e6


def lane(args) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import vsurge.multihost.wire  # noqa: F401

        impl, fn = "authenticated frames, explicit format (this checkout)", _new_lane
    except ImportError:
        impl, fn = "pickled frames (vsurge/engines/lockstep.py)", _old_lane
    print(f"lane: {impl}; {args.calls} calls each, encode + send + receive + check + decode, one process")
    for layers in [int(x) for x in args.layers.split(",")]:
        for name, us in fn(_calls(layers), args.calls).items():
            print(f"  {layers:3d} layers  {name:16s} {us:8.1f} us/call")


# ------------------------------------------------------------------------------------ a real group


def _engine(model_dir: str, mesh):
    import vsurge

    model, tok = vsurge.load_model(model_dir, mesh=mesh)
    return model, tok, dict(max_concurrent_decodes=1, max_length=64, prefill_lengths=[32], mesh=mesh)


def _time_decode(engine, steps: int) -> float:
    import jax
    import numpy as np

    from vsurge.contracts.sampling_params import SamplingParams

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
        from vsurge.seed_api.engines import vEngine

        mesh = make_mesh("tp=8")
        model, tok, kw = _engine(args.model, mesh)
        print(json.dumps({"ms": _time_decode(vEngine(model, tok, **kw), args.steps)}), flush=True)
        return
    from vsurge.contracts.engine_config import EngineConfig
    from vsurge.multihost import channel as ch
    from vsurge.multihost.engine_proxy import LeaderEngine, build_engine, engine_setup
    from vsurge.multihost.group import ProcessGroup, join
    from vsurge.multihost.lane_leader import LeaderLane
    from vsurge.multihost.lane_worker import WorkerLane

    secret = args.secret.encode()
    group = join(ProcessGroup(f"127.0.0.1:{args.port}", 2, int(args.role[-1]), "options", 120), 60.0)
    mesh = make_mesh("tp=8")
    if group.is_leader:
        lane = LeaderLane(group, secret, 60.0, host="127.0.0.1")
        lane.start()
        model, tok, kw = _engine(args.model, mesh)
        lane.wait_workers("loaded", 600, "load")
        config = EngineConfig(**kw, driver="vdriver")
        engine = build_engine(model, tok, config)
        lane.send_control(ch.ENGINE, engine_setup(engine, config.replace(mesh="tp=8")))
        proxy = LeaderEngine(engine, lane)
        print(json.dumps({"ms": _time_decode(proxy, args.steps)}), flush=True)
        lane.close()
        os._exit(0)
    worker = WorkerLane(group, secret, 60.0, exit=lambda code, why: os._exit(code))
    worker.connect(120)
    model, tok, _ = _engine(args.model, mesh)
    worker.loaded(mesh)
    os._exit(worker.run(model, tok))


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


def _run(args, role: str, devices: int, port: int = 0, secret: str = "") -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        __file__,
        "steps",
        "--child",
        role,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
    ]
    cmd += ["--port", str(port), "--secret", secret]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def _ms(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate(timeout=1800)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode not in (0, None) and not lines:
        raise SystemExit(f"a benchmark process failed ({proc.returncode})")
    return json.loads(lines[-1])["ms"]


def steps(args) -> None:
    if args.child:
        args.role = args.child
        return child(args)
    if not args.model:
        raise SystemExit("steps: --model DIR is required")
    rows = []
    for r in range(args.rounds):
        single = _ms(_run(args, "single", 8))
        port, secret = _free_port(), secrets.token_urlsafe(32)
        worker = _run(args, "group1", 4, port, secret)
        leader = _run(args, "group0", 4, port, secret)
        group = _ms(leader)
        worker.wait(timeout=120)
        rows.append((single, group))
        print(
            f"round {r}: 1 process x 8 devices {single:.1f} ms/step | 2 processes x 4 devices {group:.1f} ms/step"
        )
    s = sorted(x for x, _ in rows)[len(rows) // 2]
    g = sorted(y for _, y in rows)[len(rows) // 2]
    print(f"median: single {s:.1f} ms, group {g:.1f} ms, ratio group/single {g / s:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("lane", help="the lane alone, per call (before/after comparable)")
    a.add_argument("--calls", type=int, default=2000)
    a.add_argument("--layers", default="2,32")
    b = sub.add_parser("steps", help="decode steps of a 2-process group against one process")
    b.add_argument("--model")
    b.add_argument("--steps", type=int, default=30)
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--child", help=argparse.SUPPRESS)
    b.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    b.add_argument("--secret", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    return lane(args) if args.mode == "lane" else steps(args)


if __name__ == "__main__":
    main()
