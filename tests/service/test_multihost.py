"""Multi-host slices on CPU: real `vsurge serve` processes on loopback forming one JAX process group (gloo),
one mesh over all their devices, the leader serving the official `openai` client and the workers replaying
its engine calls over the step lane (vsurge/engines/lockstep.py).

Fast tests: where the group comes from (options, LeaderWorkerSet variables) and a worker without a leader.
The serving matrix (processes x devices x mesh x driver) compiles a whole engine per group: slow.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vsurge.cli import ConfigError, parse_serve_config
from vsurge.distributed import COORDINATOR_PORT, ProcessGroup, resolve

# ------------------------------------------------------------------------------------ the group


def test_options_make_the_group():
    g = resolve("10.0.0.1:9000", 4, 2, env={})
    assert g == ProcessGroup("10.0.0.1:9000", 4, 2, "options")
    assert not g.is_leader and g.lane_address() == ("10.0.0.1", 9001)


def test_leaderworkerset_variables_make_the_group():
    env = {"LWS_LEADER_ADDRESS": "m-0.m.ns", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "0"}
    g = resolve(env=env)
    assert g.coordinator_address == f"m-0.m.ns:{COORDINATOR_PORT}" and g.num_processes == 4
    assert g.is_leader and g.source == "LeaderWorkerSet"
    # explicit options win over the LeaderWorkerSet's
    assert resolve("h:1234", 2, 1, env=env).coordinator_address == "h:1234"


def test_no_group_and_bad_groups():
    assert resolve(env={}) is None
    assert resolve("h:1", 1, 0, env={}) is None  # a group of one is a single process
    with pytest.raises(ValueError, match="needs all of"):
        resolve("h:1", None, 0, env={})
    with pytest.raises(ValueError, match="outside a group of 2"):
        resolve("h:1", 2, 2, env={})
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX"):
        resolve(env={"LWS_LEADER_ADDRESS": "a", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "x"})


def test_serve_reads_the_group_options():
    cfg = parse_serve_config(
        ["--coordinator-address", "h:8476", "--num-processes", "2"], env={"VSURGE_PROCESS_ID": "1"}
    )
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("h:8476", 2, 1)
    with pytest.raises(ConfigError, match="VSURGE_COORDINATOR_ADDRESS"):
        parse_serve_config([], env={"VSURGE_COORDINATOR_ADDRESS": "no-port"})
    with pytest.raises(SystemExit):
        parse_serve_config(["--process-id", "-1"], env={})


# ------------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports() -> tuple[int, int]:
    """(HTTP port, coordinator port) with the coordinator port + 1 (the step lane) free too."""
    while True:
        c = _free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", c + 1))
        except OSError:
            continue
        return _free_port(), c


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VSURGE_", "LWS_", "TPU_"))}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        VSURGE_LANE_TIMEOUT="20",  # 2 shared cores: a starved leader may not ping for seconds
    )
    env.update(extra)
    return env


class Group:
    """`vsurge serve` x N on loopback: process 0 serves HTTP, the others are its workers."""

    def __init__(self, tmp: Path, model: str, processes: int, devices: int, mesh: str, driver: str):
        self.port, coordinator = _ports()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = [tmp / f"process-{i}.log" for i in range(processes)]
        self.procs = []
        for i in range(processes):
            env = _env(
                devices,
                VSURGE_COORDINATOR_ADDRESS=f"127.0.0.1:{coordinator}",
                VSURGE_NUM_PROCESSES=str(processes),
                VSURGE_PROCESS_ID=str(i),
                VSURGE_JOIN_TIMEOUT="120",
                VSURGE_MODEL=model,
                VSURGE_SERVED_MODEL_NAME="tiny",
                VSURGE_MESH=mesh,
                VSURGE_DRIVER=driver,
                VSURGE_MAX_LENGTH="64",
                VSURGE_PREFILL_LENGTHS="32",
                VSURGE_MAX_CONCURRENT_DECODES="2",
                VSURGE_PAGE_SIZE="16",
                VSURGE_HOST="127.0.0.1",
                VSURGE_PORT=str(self.port),
                VSURGE_METRICS_PORT="-1",
            )
            cmd = [sys.executable, "-c", "import sys; from vsurge.cli import main; sys.exit(main())", "serve"]
            with open(self.logs[i], "w") as log:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    def log(self, i: int = 0) -> str:
        text = self.logs[i].read_text(errors="replace")
        return "\n".join(line for line in text.splitlines() if "[Gloo]" not in line)[-4000:]

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"process {i} exited {p.returncode}:\n{self.log(i)}"
            try:
                if httpx.get(f"{self.url}/readiness", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"not ready in {timeout}s:\n{self.log(0)}\n{self.log(1)}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)


PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 61, 88, 12, 250, 9]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama whose 8 KV heads split over tp=8, and its single-process greedy reference."""
    from tiny_models import make_checkpoint

    import vsurge
    from vsurge.models.reference import greedy_by_recompute

    d = tmp_path_factory.mktemp("mh-ckpt")
    make_checkpoint(d, "llama", heads=8, kv_heads=8, hidden=64, layers=2)
    model, _ = vsurge.load_model(str(d))  # one device, one process
    return str(d), [greedy_by_recompute(model, p, MAX_TOKENS) for p in PROMPTS]


def _client(group: Group):
    import openai

    return openai.OpenAI(base_url=f"{group.url}/v1", api_key="none", max_retries=0, timeout=120)


def _greedy_tokens(client, prompt: list[int]) -> list[int]:
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(r.choices[0].model_extra["token_ids"])


def _held(group: Group, i: int) -> tuple[float, float]:
    m = re.search(r"holds ([0-9.]+) MiB of the model's ([0-9.]+) MiB", group.logs[i].read_text())
    assert m, group.log(i)
    return float(m.group(1)), float(m.group(2))


def _serve_and_compare(tmp_path, checkpoint, processes, devices, mesh, driver) -> Group:
    model, reference = checkpoint
    group = Group(tmp_path, model, processes, devices, mesh, driver)
    try:
        group.wait_ready()
        for i in range(processes):
            local, total = _held(group, i)
            if mesh == "tp=8":  # tp spans the processes: each holds (and read) only its devices' shards
                assert local < total * 0.75, (i, local, total)
            else:  # dp=2 over two processes: each holds a whole tp=4 replica
                assert local == total, (i, local, total)
        client = _client(group)
        got = [_greedy_tokens(client, p) for p in PROMPTS]
        assert got == reference, f"{processes}x{devices} {mesh} {driver}: {got} != {reference}"
    except BaseException:
        group.close()
        raise
    return group


@pytest.mark.slow  # compiles a sharded engine in two processes: minutes on 2 shared cores
@pytest.mark.timeout(1800)
def test_two_processes_tp8_vdriver_then_a_worker_dies(tmp_path, checkpoint):
    group = _serve_and_compare(tmp_path, checkpoint, 2, 4, "tp=8", "vdriver")
    try:
        import openai

        client = _client(group)
        # a long stream is running when the worker dies: it ends with 503 engine_unavailable, never hangs
        stream = client.completions.create(
            model="tiny",
            prompt=PROMPTS[0],
            max_tokens=50,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        group.procs[1].kill()
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            for _ in stream:
                pass
        assert "engine_unavailable" in str(err.value) or "unavailable" in str(err.value).lower()
        r = httpx.post(
            f"{group.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        assert r.headers["Retry-After"]
        assert httpx.get(f"{group.url}/readiness", timeout=10).status_code == 503
        rc = group.procs[0].wait(timeout=60)
        assert rc != 0 and time.monotonic() - t0 < 30, group.log(0)
        assert "worker 1 closed the step lane" in group.log(0)
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_processes_dp2_tp4_odriver_then_a_worker_hangs(tmp_path, checkpoint):
    group = _serve_and_compare(tmp_path, checkpoint, 2, 4, "dp=2,tp=4", "odriver")
    try:
        os.kill(group.procs[1].pid, signal.SIGSTOP)  # alive but silent: the heartbeat times out (20 s here)
        t0 = time.monotonic()
        rc = group.procs[0].wait(timeout=60)
        assert rc != 0 and time.monotonic() - t0 < 60, group.log(0)
        assert "worker 1 sent no heartbeat" in group.log(0)
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(group.procs[1].pid, signal.SIGCONT)
        group.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_four_processes_two_devices_each(tmp_path, checkpoint):
    group = _serve_and_compare(tmp_path, checkpoint, 4, 2, "tp=8", "vdriver")
    try:
        group.procs[0].send_signal(signal.SIGINT)  # a drain: the leader stops its workers, all exit 0
        assert group.procs[0].wait(timeout=120) == 0, group.log(0)
        for i, p in enumerate(group.procs[1:], 1):
            assert p.wait(timeout=60) == 0, group.log(i)
    finally:
        group.close()


def test_a_worker_without_a_leader_exits_with_a_message(tmp_path):
    _, coordinator = _ports()
    env = _env(
        2,
        VSURGE_COORDINATOR_ADDRESS=f"127.0.0.1:{coordinator}",
        VSURGE_NUM_PROCESSES="2",
        VSURGE_PROCESS_ID="1",
        VSURGE_JOIN_TIMEOUT="3",
        VSURGE_MODEL=str(tmp_path / "never-loaded"),
    )
    cmd = [sys.executable, "-c", "import sys; from vsurge.cli import main; sys.exit(main())", "serve"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "process 1 could not join the group of 2 processes" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------------ the lane, in one process


def test_the_step_lane_replays_every_call_on_a_second_engine(checkpoint, monkeypatch):
    """Leader and worker engines in one process (one device, no collectives), joined by a real step lane:
    the worker's engine, fed only what crosses the lane, makes the leader's tokens; a worker that goes
    silent breaks the lane and every later call says so."""
    import threading

    import jax
    import numpy as np

    import vsurge
    from vsurge.distributed import EngineUnavailableError
    from vsurge.engine_config import EngineConfig
    from vsurge.engines import lockstep
    from vsurge.sampling_params import SamplingParams

    monkeypatch.setattr(lockstep, "LANE_TIMEOUT_S", 5.0)  # the silent worker below is noticed sooner
    model_dir, reference = checkpoint
    model, tok = vsurge.load_model(model_dir)
    _, coordinator = _ports()
    group = ProcessGroup(f"127.0.0.1:{coordinator}", 2, 0, "options")
    lane = lockstep.LeaderLane(group, host="127.0.0.1")
    exits = []
    worker = lockstep.Worker(
        ProcessGroup(group.coordinator_address, 2, 1, "options"), model, tok, None, exit=exits.append
    )
    done = {}
    threading.Thread(
        target=lambda: (worker.connect(30), done.setdefault("rc", worker.run())), daemon=True
    ).start()
    lane.accept(30)
    config = EngineConfig(max_concurrent_decodes=2, max_length=64, prefill_lengths=(32,))
    engine = lockstep.build_engine(model, tok, config)
    lane._send(("engine", lockstep.engine_setup(engine, config)))
    proxy = lockstep.LeaderEngine(engine, lane)

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    state = proxy.init_decode_state()
    rows = [[] for _ in PROMPTS]
    for slot, prompt in enumerate(PROMPTS):
        prefix = proxy.prefill(prompt, greedy)
        state, first = proxy.insert(prefix, state, slot, length=len(prompt))
        rows[slot].append(int(np.asarray(first.tokens)[0]))
    for _ in range(MAX_TOKENS - 1):
        state, out = proxy.decode(state)
        for slot, t in enumerate(np.asarray(out.tokens)[: len(PROMPTS)]):
            rows[slot].append(int(t))
    assert rows == reference and not exits
    # the worker ran the same calls: its decode state holds the same next tokens as the leader's
    n = lane._calls - 1  # the last decode: its result leaves are handles (n, i) on the worker
    leader_leaves = jax.tree_util.tree_leaves((state, out))
    tokens_index = next(i for i, x in enumerate(leader_leaves) if x is state.tokens)
    # the worker counts a call when it starts it and holds its results once it has run it
    deadline = time.monotonic() + 30
    while (n, tokens_index) not in worker.handles and time.monotonic() < deadline:
        time.sleep(0.05)
    assert np.array_equal(np.asarray(worker.handles[(n, tokens_index)]), np.asarray(state.tokens))
    assert proxy.check_prompt([1, 2, 3]) == 3 and lane._calls == n + 1  # host-only: not sent

    # the worker goes silent (no heartbeat): the lane breaks within its timeout, calls say so
    worker._closed = True
    t0 = time.monotonic()
    assert lane.wait_failed(lockstep.LANE_TIMEOUT_S + 10), "the lane did not notice a silent worker"
    assert time.monotonic() - t0 <= lockstep.LANE_TIMEOUT_S + 10
    with pytest.raises(EngineUnavailableError, match="worker 1"):
        proxy.decode(state)
    lane.close()
