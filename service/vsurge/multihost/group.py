"""Which JAX process group this `vsurge serve` joins, and joining it.

A slice larger than one host runs one `vsurge serve` per host (one pod per host of a LeaderWorkerSet). They
form one JAX process group, so the mesh covers every chip of the slice; process 0 (the leader) serves HTTP
and schedules, the others (workers) replay its engine calls in lockstep (``multihost/lane_*.py``).

Where the group comes from, first match wins:

1. ``--coordinator-address HOST:PORT --num-processes N --process-id I`` (or ``VSURGE_COORDINATOR_ADDRESS``,
   ``VSURGE_NUM_PROCESSES``, ``VSURGE_PROCESS_ID``);
2. a LeaderWorkerSet pod: ``LWS_LEADER_ADDRESS`` (the leader pod's DNS name) on ``COORDINATOR_PORT``,
   ``LWS_GROUP_SIZE`` processes, ``LWS_WORKER_INDEX`` as the process id (the leader is index 0);
3. a multi-host Cloud TPU slice without either (``TPU_WORKER_HOSTNAMES`` lists several hosts): JAX's own
   TPU cluster detection (``jax.distributed.initialize()`` without arguments);
4. otherwise one process: nothing is joined.

The step lane (the leader's socket the workers replay from) listens on the coordinator's host at
``coordinator port + LANE_PORT_OFFSET``. This module imports no jax at the top: the command line reads it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

COORDINATOR_PORT = 8476  # JAX's coordinator on the leader (the port JAX's TPU detection uses too)
LANE_PORT_OFFSET = 1  # the step lane: coordinator port + 1 (8477 by default)
DEFAULT_JOIN_TIMEOUT_S = 300.0
DEFAULT_LANE_TIMEOUT_S = 10.0
# What a LeaderWorkerSet injects into every pod of a group (read here, set by the LWS controller).
LWS_VARIABLES = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


def lane_timeout(env: Mapping[str, str] | None = None) -> float:
    """``VSURGE_LANE_TIMEOUT_S`` (default 10 s): the bound on noticing a dead or wedged process. A peer
    silent for 60% of it, or a step running longer than it, breaks the group (``lane_leader.py``)."""
    env = os.environ if env is None else env
    text = env.get("VSURGE_LANE_TIMEOUT_S", "").strip()
    if not text:
        return DEFAULT_LANE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"VSURGE_LANE_TIMEOUT_S: expected seconds, got {text!r}") from None
    if not 1.0 <= value <= 3600.0:
        raise ValueError(f"VSURGE_LANE_TIMEOUT_S: must be between 1 and 3600 seconds, got {value:g}")
    return value


def jax_heartbeat_timeout(lane_timeout_s: float) -> int:
    """JAX's coordination service aborts every process once a peer misses its heartbeats (it fired ~18 s
    into a 30 s setting here): kept well above the lane's bound, so the lane notices first and in-flight
    requests get their 503 and every log its clear message before JAX's abort."""
    return int(max(30.0, 4 * lane_timeout_s + 20))


@dataclass(frozen=True)
class ProcessGroup:
    """One process's place in a multi-host group. ``coordinator_address`` None: JAX's TPU detection."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "options", "LeaderWorkerSet" or "tpu"
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def lane_address(self) -> tuple[str, int]:
        """(host, port) of the leader's step lane."""
        if self.coordinator_address is None:
            raise ValueError("the step lane address is known once the group is joined")
        host, port = split_address(self.coordinator_address)
        return host, port + LANE_PORT_OFFSET


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) -> (host, port); ValueError naming the problem."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def parse_address(text: str) -> str:
    split_address(text.strip())
    return text.strip()


def parse_non_negative(text: str) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise ValueError(f"must be >= 0, got {v}")
    return v


def _int_env(env: Mapping[str, str], name: str) -> int:
    try:
        return parse_non_negative(env[name])
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S,
) -> ProcessGroup | None:
    """The group this process belongs to (see the module docstring), or None for a single process."""
    env = os.environ if env is None else env
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if any(given):
        if not all(given):
            raise ValueError(
                "a multi-host group needs all of --coordinator-address, --num-processes and --process-id "
                "(VSURGE_COORDINATOR_ADDRESS, VSURGE_NUM_PROCESSES, VSURGE_PROCESS_ID)"
            )
        group = ProcessGroup(coordinator_address, num_processes, process_id, "options", join_timeout)
    elif all(env.get(n) for n in LWS_VARIABLES):
        size, index = _int_env(env, "LWS_GROUP_SIZE"), _int_env(env, "LWS_WORKER_INDEX")
        address = f"{env['LWS_LEADER_ADDRESS']}:{COORDINATOR_PORT}"
        group = ProcessGroup(address, size, index, "LeaderWorkerSet", join_timeout)
    elif len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        hosts = [h.strip() for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h.strip()]
        index = env.get("TPU_WORKER_ID")
        pid = _int_env(env, "TPU_WORKER_ID") if index else None
        # the lane needs the leader's host: JAX's detection picks worker 0 as coordinator too
        return ProcessGroup(f"{hosts[0]}:{COORDINATOR_PORT}", len(hosts), pid, "tpu", join_timeout)
    else:
        return None
    if group.num_processes < 1 or not 0 <= group.process_id < group.num_processes:
        raise ValueError(
            f"process id {group.process_id} is outside a group of {group.num_processes} processes"
        )
    if group.num_processes == 1:
        return None  # a group of one is a single process
    split_address(group.coordinator_address)
    return group


def join(group: ProcessGroup, lane_timeout_s: float = DEFAULT_LANE_TIMEOUT_S) -> ProcessGroup:
    """Join the JAX process group (before any other JAX call); returns the group with its process id.

    On CPU the collectives go over gloo, and every program runs to its end before the next one starts
    (see ``cpu_programs.serialize_cpu_programs``). Raises RuntimeError with a clear message when the others
    do not come.
    """
    import jax

    from .cpu_cache_keys import share_cpu_cache_keys
    from .cpu_programs import serialize_cpu_programs

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = max(1, int(group.join_timeout))
    beat = jax_heartbeat_timeout(lane_timeout_s)
    if not group.is_leader and group.coordinator_address is not None:
        # JAX aborts the process when its coordinator never answers: find it first, and say so if not
        wait_for_coordinator(group, group.join_timeout)
    try:
        if group.source == "tpu":
            jax.distributed.initialize(initialization_timeout=timeout, heartbeat_timeout_seconds=beat)
        else:
            jax.distributed.initialize(
                group.coordinator_address,
                group.num_processes,
                group.process_id,
                initialization_timeout=timeout,
                heartbeat_timeout_seconds=beat,
            )
    except Exception as e:  # noqa: BLE001 - said in our words, with what JAX said
        role = "the leader" if group.is_leader else f"process {group.process_id}"
        raise RuntimeError(
            f"{role} could not join the group of {group.num_processes} processes at "
            f"{group.coordinator_address} within {timeout}s ({type(e).__name__}: {str(e)[:300]})"
        ) from None
    if group.source == "tpu":
        group = ProcessGroup(
            group.coordinator_address, jax.process_count(), jax.process_index(), "tpu", group.join_timeout
        )
    if jax.default_backend() == "cpu":
        serialize_cpu_programs()
        share_cpu_cache_keys()
    log.info(
        "joined process group: process %d of %d (%s), %d of %d devices here",
        group.process_id,
        group.num_processes,
        group.source,
        jax.local_device_count(),
        jax.device_count(),
    )
    return group


def backoff(first: float = 0.2, most: float = 5.0):
    """Waits between attempts to reach a peer that is not up yet: doubling from ``first`` to ``most``."""
    wait = first
    while True:
        yield wait
        wait = min(most, wait * 2)


def wait_for_coordinator(group: ProcessGroup, timeout: float) -> None:
    """Return once the coordinator's port accepts connections (retrying with backoff: the leader's pod may
    start minutes after this one); RuntimeError after ``timeout`` seconds."""
    import socket
    import time

    host, port = split_address(group.coordinator_address)
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    for wait in backoff():
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError as e:
            last = e
        if time.monotonic() + wait > deadline:
            raise RuntimeError(
                f"process {group.process_id} could not join the group of {group.num_processes} processes: "
                f"no leader (JAX coordinator) at {group.coordinator_address} after {timeout:.0f}s ({last})"
            )
        time.sleep(wait)


def check_mesh(mesh: Any) -> None:
    """A multi-host engine's mesh must cover every device of the group: each process owns its part."""
    import jax

    if mesh is None:
        raise ValueError(
            f"a multi-host group of {jax.process_count()} processes needs a mesh over all "
            f"{jax.device_count()} devices: set --mesh / VSURGE_MESH (e.g. tp={jax.device_count()})"
        )
    size = int(mesh.devices.size)
    if size != jax.device_count():
        raise ValueError(
            f"mesh {dict(mesh.shape)} covers {size} devices but the group of {jax.process_count()} "
            f"processes has {jax.device_count()}: a multi-host mesh must cover every device"
        )
