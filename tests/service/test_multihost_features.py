"""Every engine feature through the step lane, on each topology of the multi-host matrix, against one
process; then a fault, timed against the lane's bound (VSURGE_LANE_TIMEOUT_S: 30 s on this shared machine,
VSURGE_TEST_LANE_TIMEOUT_S=10 measures the default's).

| group | mesh | driver, features | then |
|---|---|---|---|
| 2 x 4 | tp=8 | vdriver: int8, mixed steps (in-place prefill), n-gram speculation, structured | forged peers; kill -9 a worker mid-stream |
| 2 x 4 | dp=2,tp=4 | odriver: int8, mixed steps, structured | kill -9 the leader mid-stream |
| 4 x 2 | tp=8 | vdriver: as the first | SIGSTOP a worker mid-stream |

Each group answers the same requests (multihost_checks.run_requests: greedy, a chunked prompt, a
repetitive prompt, seeded samples with n=2, a regex) with the same tokens as a single `vsurge serve` of the
same configuration over 8 devices. Slow: each group compiles a sharded engine in every process.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from multihost_checks import concurrent_burst, forged_peers, inject_fault, run_requests, speculation
from multihost_group import TEST_LANE_TIMEOUT_S, Group

BOUND_S = TEST_LANE_TIMEOUT_S
VDRIVER = {
    "VSURGE_QUANTIZATION": "int8",
    # one chunk shape per row bucket (24 prompt tokens a step): half the mixed programs of a larger budget
    "VSURGE_MAX_NUM_BATCHED_TOKENS": "32",
    "VSURGE_SPECULATIVE": "ngram",
    "VSURGE_NUM_SPECULATIVE_TOKENS": "3",
}
ODRIVER = {"VSURGE_QUANTIZATION": "int8", "VSURGE_MAX_NUM_BATCHED_TOKENS": "64"}
CONFIGS = {"vdriver": ("tp=8", "vdriver", VDRIVER), "odriver": ("dp=2,tp=4", "odriver", ODRIVER)}


def _requests(group: Group, config: str) -> dict:
    return run_requests(group)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tiny_models import make_checkpoint

    d = tmp_path_factory.mktemp("mh-features")
    make_checkpoint(d, "llama", heads=8, kv_heads=8, hidden=64, layers=2)
    return str(d)


@pytest.fixture(scope="module")
def one_process(checkpoint, tmp_path_factory):
    """What one `vsurge serve` over 8 devices answers, per configuration (computed once)."""
    seen: dict[str, dict] = {}

    def get(config: str) -> dict:
        if config not in seen:
            mesh, driver, engine = CONFIGS[config]
            group = Group(tmp_path_factory.mktemp(f"one-{config}"), checkpoint, 1, 8, mesh, driver, engine)
            try:
                group.wait_ready()
                seen[config] = _requests(group, config)
            finally:
                group.close()
        return seen[config]

    return get


def _serve(tmp_path, checkpoint, processes, devices, config, one_process) -> Group:
    mesh, driver, engine = CONFIGS[config]
    reference = one_process(config)
    group = Group(tmp_path, checkpoint, processes, devices, mesh, driver, engine)
    try:
        group.wait_ready()
        got = _requests(group, config)
        for name, want in reference.items():
            assert got[name] == want, f"{processes}x{devices} {mesh} {config} {name}: {got[name]} != {want}"
        if driver == "vdriver":
            print(f"\n{processes}x{devices} {mesh}: {speculation(group)}")
        concurrent_burst(group)
    except BaseException:
        group.close()
        raise
    return group


def _check_bound(times, group: Group, leader_exits: bool = True) -> None:
    print(f"\n{times.line(BOUND_S)}")
    assert times.stream_error is not None and times.stream_error <= BOUND_S, times
    if leader_exits:
        code, at = times.exits[0]
        assert code == 1 and at <= BOUND_S, (times, group.log(0))
    if times.unready is not None or leader_exits:
        assert times.unready is not None and times.unready <= BOUND_S, times
        assert times.new_503 is not None and times.new_503 <= BOUND_S, times


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_processes_tp8_vdriver_features_forged_peers_then_a_worker_dies(
    tmp_path, checkpoint, one_process
):
    group = _serve(tmp_path, checkpoint, 2, 4, "vdriver", one_process)
    try:
        tried = forged_peers(group, tmp_path)
        print("\nforged peers, each refused and logged:\n  " + "\n  ".join(tried))
        refused = [line for line in group.log(0).splitlines() if "step lane: refused a connection" in line]
        print("the leader's log:\n  " + "\n  ".join(refused))
        assert len(refused) >= len(tried), group.log(0)
        assert "refused" not in group.log(1) and "failed" not in group.log(1)
        # the group keeps serving, with the same tokens
        assert _requests(group, "vdriver") == one_process("vdriver")

        times = inject_fault(group, "kill -9 worker", 1, lambda p: p.kill())
        _check_bound(times, group)
        # the leader hears the death on whichever side of the lane meets it first: its reader (the
        # worker closed the lane) or its next send to the worker (a broken pipe / reset)
        said = [line for line in group.log(0).splitlines() if "worker 1" in line]
        assert any(
            "closed the step lane" in line or re.search(r"sending to \S+ failed", line) for line in said
        ), group.log(0)
        assert "worker 1" in group.termination[0].read_text()  # what the operator reports
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_processes_dp2_tp4_odriver_features_then_the_leader_dies(tmp_path, checkpoint, one_process):
    group = _serve(tmp_path, checkpoint, 2, 4, "odriver", one_process)
    try:
        times = inject_fault(group, "kill -9 leader", 0, lambda p: p.kill())
        print(f"\n{times.line(BOUND_S)}")
        assert times.stream_error is not None and times.stream_error <= BOUND_S, times
        code, at = times.exits[1]
        assert code == 3 and at <= BOUND_S, (times, group.log(1))
        assert "lost the leader's step lane" in group.log(1)
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_four_processes_two_devices_vdriver_features_then_a_worker_stops(tmp_path, checkpoint, one_process):
    group = _serve(tmp_path, checkpoint, 4, 2, "vdriver", one_process)
    try:
        times = inject_fault(group, "SIGSTOP worker", 2, lambda p: os.kill(p.pid, signal.SIGSTOP))
        _check_bound(times, group)
        assert "worker 2" in group.log(0) and "sent nothing" in group.log(0)
        for i in (1, 3):  # the other workers were told why and exited 1 with it
            assert times.exits[i][0] == 1 and "the group failed: worker 2" in group.log(i), group.log(i)
    finally:
        import contextlib

        with contextlib.suppress(ProcessLookupError):
            os.kill(group.procs[2].pid, signal.SIGCONT)
        group.close()
