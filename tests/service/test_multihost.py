"""Multi-host slices on CPU: real `vsurge serve` processes on loopback forming one JAX process group (gloo),
one mesh over all their devices, the leader serving the official `openai` client and the workers replaying
its engine calls over the authenticated step lane (vsurge/multihost).

Fast tests: where the group comes from (options, LeaderWorkerSet variables), a worker without a leader, a
group without a lane secret. The serving matrix (processes x devices x mesh x driver) compiles a whole
engine per group: slow; so does the one group at the lane's default bound (10 s; the others run at 30 s).
Every feature, then faults and forged peers, at the 30 s bound: test_multihost_features.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest
from multihost_checks import inject_fault
from multihost_group import SERVE, TEST_LANE_TIMEOUT_S, Group, base_env, client, held, ports, write_secret
from patience import ceiling

from vsurge.cli.main import ConfigError, parse_serve_config
from vsurge.multihost.group import (
    COORDINATOR_PORT,
    DEFAULT_LANE_TIMEOUT_S,
    ProcessGroup,
    lane_timeout,
    resolve,
)
from vsurge.multihost.lane_leader import SILENCE

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


def _greedy_tokens(client, prompt: list[int]) -> list[int]:
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(r.choices[0].model_extra["token_ids"])


@pytest.mark.slow  # compiles a sharded engine in two processes: a minute or more on 2 shared cores
@pytest.mark.timeout(1800)
def test_the_group_forms_when_the_leader_comes_late_then_drains(tmp_path, checkpoint):
    """The worker starts first and waits (backoff) for a leader that comes 20 s later; the group forms,
    each process holds only its shards, serves the single-process tokens; a drain ends every process 0."""
    model, reference = checkpoint
    group = Group(tmp_path, model, 2, 4, "tp=8", "vdriver", order=[1, 0], delay=20)
    try:
        group.wait_ready()
        for i in range(2):
            local, total = held(group, i)
            assert local < total * 0.75, (i, local, total)  # tp spans the processes: its devices' shards only
        got = [_greedy_tokens(client(group), p) for p in PROMPTS]
        assert got == reference, f"{got} != {reference}"
        group.procs[0].send_signal(signal.SIGINT)  # a drain: the leader stops its worker, both exit 0
        assert group.wait_exits(120) == [0, 0], (group.log(0), group.log(1))
        assert "the leader stopped; exiting" in group.log(1)
    finally:
        group.close()


@pytest.mark.timeout(600)  # two processes join a JAX group, nothing compiles: seconds
@pytest.mark.parametrize("broken", [0, 1], ids=["leader", "worker"])
def test_a_start_up_error_on_any_process_ends_the_whole_group(tmp_path, checkpoint, broken):
    """One process cannot load its model: every process exits 1 within the lane's bound of the error,
    and every log says why (no process waits minutes in JAX's shutdown barrier)."""
    model, _ = checkpoint
    bad = {broken: {"VSURGE_MODEL": str(tmp_path / "no-such-model")}}
    group = Group(tmp_path, model, 2, 4, "tp=8", "vdriver", env=bad)
    try:
        deadline = time.monotonic() + 300
        while all(p.poll() is None for p in group.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        first = time.monotonic()
        codes = group.wait_exits(60)
        spread = time.monotonic() - first
        print(f"\nstart-up error on process {broken}: every process exited {spread:.2f}s after the first")
        assert codes == [1, 1], (codes, group.log(0), group.log(1))
        assert spread <= TEST_LANE_TIMEOUT_S, spread
        assert "no-such-model" in group.log(0) and "no-such-model" in group.log(1)
        role = "the leader failed to start" if broken == 0 else "worker 1"
        assert role in group.log(1 - broken), group.log(1 - broken)
        # the leader's termination message (the operator reads it) names what failed
        assert ("ModelSourceError" if broken == 0 else "GroupFailedError") in group.termination[0].read_text()
        assert "no-such-model" in group.termination[0].read_text()
    finally:
        group.close()


@pytest.mark.slow  # compiles a sharded engine in two processes
@pytest.mark.timeout(1800)
def test_the_default_lane_bound_ends_a_group_whose_worker_stops(tmp_path, checkpoint):
    """VSURGE_LANE_TIMEOUT_S unset: the default bound, 10 s (the other group tests run at 30 s on this
    shared machine). A worker stopped mid-stream (SIGSTOP) is noticed once it has been silent for half the
    bound, which the leader's log says it measured (5.0 s: the default, not a shorter cause); then the
    stream ends, readiness and new requests answer 503 (engine_unavailable) and the leader exits 1, each
    within a generous ceiling above 10 s: a loaded machine is slower, not wrong. (No lower bound in the
    test's clock: a worker starved before the stop may have sent its last beat seconds earlier.) Measured
    alone: stream ended 4.46 s, unready 4.56 s, new request 503 4.46 s, leader exit 6.65 s."""
    model, _ = checkpoint
    default = {"VSURGE_LANE_TIMEOUT_S": ""}  # as unset: lane_timeout() reads a blank value as the default
    group = Group(tmp_path, model, 2, 4, "tp=8", "vdriver", env={0: default, 1: default})
    try:
        group.wait_ready()
        times = inject_fault(group, "SIGSTOP worker", 1, lambda p: os.kill(p.pid, signal.SIGSTOP))
        print(f"\n{times.line(DEFAULT_LANE_TIMEOUT_S)}")
        assert f"sent nothing for {SILENCE * DEFAULT_LANE_TIMEOUT_S:.1f}s" in group.log(0), group.log(0)
        latest = ceiling(DEFAULT_LANE_TIMEOUT_S)
        seen = {"stream ended": times.stream_error, "unready": times.unready, "new 503": times.new_503}
        for what, at in seen.items():
            assert at is not None and 0 < at <= latest, (what, times)
        assert times.new_503_code == "engine_unavailable", times
        code, at = times.exits[0]
        assert code == 1 and at <= latest, (times, group.log(0))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(group.procs[1].pid, signal.SIGCONT)
        group.close()


def test_a_worker_without_a_leader_exits_with_a_message(tmp_path):
    _, coordinator = ports()
    env = base_env(
        2,
        VSURGE_COORDINATOR_ADDRESS=f"127.0.0.1:{coordinator}",
        VSURGE_NUM_PROCESSES="2",
        VSURGE_PROCESS_ID="1",
        VSURGE_JOIN_TIMEOUT="3",
        VSURGE_MESH="tp=4",
        VSURGE_LANE_SECRET_FILE=str(write_secret(tmp_path)),
        VSURGE_MODEL=str(tmp_path / "never-loaded"),
    )
    t0 = time.monotonic()
    proc = subprocess.run(SERVE, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "process 1 could not join the group of 2 processes" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("pid", ["0", "1"])
def test_a_group_without_a_lane_secret_is_refused_before_it_joins(tmp_path, pid):
    _, coordinator = ports()
    env = base_env(
        2,
        VSURGE_COORDINATOR_ADDRESS=f"127.0.0.1:{coordinator}",
        VSURGE_NUM_PROCESSES="2",
        VSURGE_PROCESS_ID=pid,
        VSURGE_JOIN_TIMEOUT="300",
        VSURGE_MESH="tp=4",
        VSURGE_MODEL=str(tmp_path / "never-loaded"),
    )
    proc = subprocess.run(SERVE, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "needs a step-lane secret: set VSURGE_LANE_SECRET_FILE" in proc.stderr, proc.stderr[-2000:]


def test_the_lane_timeout_setting():
    assert lane_timeout({}) == 10.0
    assert lane_timeout({"VSURGE_LANE_TIMEOUT_S": "4.5"}) == 4.5
    for bad in ("0", "abc", "-3", "7200"):
        with pytest.raises(ValueError, match="VSURGE_LANE_TIMEOUT_S"):
            lane_timeout({"VSURGE_LANE_TIMEOUT_S": bad})
