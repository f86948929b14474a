"""The leader's end of the step lane: it admits the group's workers, sends every engine call, and decides
when the group has failed.

    accept thread ── handshake (channel.py) ── per worker: a reader thread (beats, errors, call failures)
    ping thread ──── PING every second (a tenth of T if shorter), with the handles of dropped arrays
    watchdog ─────── a call running past the step bound on the leader, or on a worker by its beats

Bounds (``T`` = VSURGE_LANE_TIMEOUT_S): a worker silent for ``SILENCE * T`` (its process died, was stopped
or lost the network: a worker beats every second from a thread that reports its replay loop's position),
or a call running past ``STEP * T`` anywhere (a wedged step: the beats say which process is in which call
for how long), breaks the lane. So does a worker's own error, a frame that fails its checks, or a worker
whose call failed where the leader's did not. Then every later call raises EngineUnavailableError, the
failure callbacks run (the server's 503s, the exit), and every worker is told to abort.

The listening socket stays open for the group's lifetime: later connections are authenticated and refused
(logged), so a forged peer never reaches a worker's place.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..contracts.request import EngineUnavailableError
from . import channel as ch
from . import wire
from .engine_proxy import LONG_METHODS, register_records
from .group import ProcessGroup
from .handles import LeaderHandles, Retirement

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # at most; a tenth of T when T is shorter (tests)
SILENCE = 0.5  # x T: a peer silent this long is gone
STEP = 0.75  # x T: a call running this long is wedged
HANDSHAKE_S = 5.0
# a worker's life as its beats report it (lane_worker.py)
PHASES = ("connected", "loading", "loaded", "replaying", "stopped")
MAX_HANDSHAKES = 16


def _no_arrays(h: wire.Handle) -> Any:
    raise wire.WireError("a worker's message named a device array")


def _no_values(v: wire.HostValue) -> Any:
    raise wire.WireError("a worker's message carried a device array")


def decode_plain(payload: bytes) -> Any:
    """A message with no device arrays (what workers send, and the leader's control messages)."""
    return wire.decode(payload, _no_arrays, _no_values)


class WorkerLink:
    """One connected worker, as its messages describe it."""

    def __init__(self, pid: int, conn: ch.Channel):
        self.pid, self.conn = pid, conn
        self.name = f"worker {pid}"
        self.heard = time.monotonic()
        self.phase = "connected"
        self.done = 0  # calls it has finished
        self.current: tuple[int, str, float] | None = None  # (call, path, seconds in it) at its last beat
        self.bye = threading.Event()  # it acknowledged a normal stop
        self.gone = threading.Event()  # its connection ended


class LeaderLane:
    """The leader's lane over a ``group``; ``secret`` is the group's (channel.read_secret)."""

    def __init__(self, group: ProcessGroup, secret: bytes, timeout: float, host: str = "0.0.0.0"):
        self.group, self.timeout = group, timeout
        self.heartbeat = heartbeat(timeout)
        register_records()
        self._secret = secret
        _, port = group.lane_address()
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.settimeout(0.5)
        self.port = self._server.getsockname()[1]
        self.workers: dict[int, WorkerLink] = {}
        self._expected = set(range(1, group.num_processes))
        self._joined = threading.Condition()
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.call_lock = threading.RLock()
        self.handles = LeaderHandles()
        self.retirement = Retirement()
        self._calls = 0
        self.serving = False  # the engine is compiled: from now on a call past the step bound is wedged
        self._current: tuple[int, str, float] | None = None  # the leader's own call in progress
        self._outcomes: dict[int, str | None] = {}  # call -> exception type name it raised here (None: ok)
        self._outcome_cv = threading.Condition()
        self.failure: str | None = None
        self._failed = threading.Event()
        self._callbacks: list[Callable[[str], None]] = []
        self._closed = False
        self.refused = 0  # connections refused (forged, duplicate, late)

    # ------------------------------------------------------------------ admitting workers
    def start(self) -> None:
        """Accept workers from now on (in the background), and start the heartbeats and the watchdog."""
        for target, name in (
            (self._accept_loop, "accept"),
            (self._ping_loop, "ping"),
            (self._watchdog, "watchdog"),
        ):
            threading.Thread(target=target, name=f"vsurge-lane-{name}", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(sock, addr, "too many handshakes at once")
                continue
            threading.Thread(
                target=self._admit, args=(sock, addr), name="vsurge-lane-hs", daemon=True
            ).start()

    def _refuse(self, sock: socket.socket, addr: Any, why: str) -> None:
        self.refused += 1
        print(
            f"[vsurge] step lane: refused a connection from {_peer(addr)}: {why}", file=sys.stderr, flush=True
        )
        with contextlib.suppress(OSError):
            sock.close()

    def _admit(self, sock: socket.socket, addr: Any) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(HANDSHAKE_S)
            with self._joined:
                allowed = self._expected - set(self.workers)
            try:
                pid, conn = ch.leader_handshake(
                    sock, self._secret, self.group.num_processes, allowed, _peer(addr)
                )
            except (ch.ChannelError, OSError) as e:
                return self._refuse(sock, addr, str(e) or type(e).__name__)
            link = WorkerLink(pid, conn)
            with self._joined:
                if pid in self.workers or self._closed:
                    return self._refuse(sock, addr, f"process {pid} is connected already")
                self.workers[pid] = link
                self._joined.notify_all()
            if self.failure is not None:  # the group failed before this worker came: it learns why
                with contextlib.suppress(ch.ChannelError):
                    conn.send(ch.ABORT, wire.encode(self.failure, self.handles.ref))
            conn.settimeout(SILENCE * self.timeout)
            log.info("step lane: %s connected from %s", link.name, _peer(addr))
            threading.Thread(
                target=self._read_loop, args=(link,), name=f"vsurge-lane-read-{pid}", daemon=True
            ).start()
        finally:
            self._slots.release()

    def wait_workers(self, phase: str, timeout: float, what: str) -> None:
        """Until every worker has reached ``phase`` ("connected", "loaded"): EngineUnavailableError if the
        lane fails first (a worker's error, a dead worker) or after ``timeout`` seconds, naming who is
        missing (the lane fails then too, so every worker exits)."""
        deadline = time.monotonic() + timeout
        want = PHASES.index(phase)
        with self._joined:
            while True:
                self.check()
                missing = [
                    p
                    for p in sorted(self._expected)
                    if p not in self.workers or PHASES.index(self.workers[p].phase) < want
                ]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    states = ", ".join(
                        f"worker {p}: " + (self.workers[p].phase if p in self.workers else "never connected")
                        for p in missing
                    )
                    reason = f"the group did not {what} within {timeout:.0f}s ({states})"
                    self.fail(reason)
                    raise EngineUnavailableError(reason)
                self._joined.wait(min(left, 0.5))

    # ------------------------------------------------------------------ failure
    def on_failure(self, fn: Callable[[str], None]) -> Callable[[], None]:
        """Call ``fn(reason)`` once the lane breaks (at once if it is broken); returns its remover."""
        self._callbacks.append(fn)
        if self.failure is not None:
            fn(self.failure)
        return lambda: self._callbacks.remove(fn) if fn in self._callbacks else None

    def fail(self, reason: str) -> None:
        """Break the lane: later calls raise, callbacks run, every worker is told to abort."""
        with self._joined:
            if self.failure is not None or self._closed:
                return
            self.failure = reason
            self._joined.notify_all()
        print(f"[vsurge] multi-host group failed: {reason}", file=sys.stderr, flush=True)
        self._failed.set()
        self._broadcast(ch.ABORT, reason)
        for fn in list(self._callbacks):
            try:
                fn(reason)
            except Exception:
                log.exception("failure callback")

    def wait_failed(self, timeout: float) -> bool:
        return self._failed.wait(timeout)

    def check(self) -> None:
        if self.failure is not None:
            raise EngineUnavailableError(f"the multi-host group failed ({self.failure})")

    # ------------------------------------------------------------------ from the workers
    def _read_loop(self, link: WorkerLink) -> None:
        try:
            self._read(link)
        finally:
            link.gone.set()

    def _read(self, link: WorkerLink) -> None:
        """A worker's messages until it hangs up (after a failure: only waiting for it to hang up)."""
        while not self._closed:
            try:
                kind, payload = link.conn.recv()
                msg = decode_plain(payload)
            except TimeoutError:
                if self.failure is None:
                    at = f"{link.phase}, {link.done} calls done"
                    if link.current is not None:
                        at += f", in call {link.current[0]} ({link.current[1]})"
                    self.fail(
                        f"{link.name} sent nothing for {SILENCE * self.timeout:.1f}s: its process is gone, "
                        f"stopped or cut off (last heard: {at})"
                    )
                return
            except (ch.ChannelError, wire.WireError) as e:
                if self.failure is None and not self._closed and not link.bye.is_set():
                    closed = isinstance(e, ch.PeerClosed)
                    self.fail(
                        f"{link.name} closed the step lane ({e}: its process died?)"
                        if closed
                        else f"{link.name}: {e}"
                    )
                return
            link.heard = time.monotonic()
            if self.failure is not None:
                continue
            try:
                if kind == ch.BEAT:
                    self._beat(link, msg)
                elif kind == ch.ERROR:
                    self.fail(f"{link.name}: {msg}")
                elif kind == ch.CALL_FAILED:
                    self._call_failed(link, *msg)
                elif kind == ch.BYE:
                    link.bye.set()
                    return
                else:
                    self.fail(f"{link.name} sent a {ch.KINDS[kind]} frame (protocol error)")
            except (wire.WireError, TypeError, ValueError) as e:  # a message of the wrong shape
                self.fail(f"{link.name} sent a malformed {ch.KINDS[kind]} message ({e})")

    def _beat(self, link: WorkerLink, msg: Any) -> None:
        phase, done, current, name = msg
        if phase not in PHASES:
            raise wire.WireError(f"unknown phase {phase!r}")
        if name and link.name == f"worker {link.pid}":
            link.name = f"worker {link.pid} ({name})"
        with self._joined:
            link.phase, link.done = phase, done
            link.current = tuple(current) if current is not None else None
            self._joined.notify_all()

    def _call_failed(self, link: WorkerLink, n: int, path: str, error: str) -> None:
        """A worker's call raised: fine when the leader's raised the same, divergence otherwise."""
        deadline = time.monotonic() + STEP * self.timeout
        with self._outcome_cv:
            while n not in self._outcomes and self.failure is None and time.monotonic() < deadline:
                self._outcome_cv.wait(0.2)
            here = self._outcomes.get(n, "unknown")
        if here is not None and here != "unknown" and error.startswith(here + ":"):
            log.info("%s: call %d %s raised %s, as on the leader", link.name, n, path, error)
            return
        said = "succeeded" if here is None else f"raised {here}" if here != "unknown" else "did not finish"
        self.fail(f"{link.name} diverged: call {n} ({path}) raised {error} there and {said} on the leader")

    # ------------------------------------------------------------------ to the workers
    def _broadcast(self, kind: int, msg: Any, payload: bytes | None = None) -> None:
        if payload is None:
            payload = wire.encode(msg, self.handles.ref)
        for link in list(self.workers.values()):
            try:
                link.conn.send(kind, payload)
            except ch.ChannelError as e:
                if kind not in (ch.ABORT, ch.STOP):
                    threading.Thread(target=self.fail, args=(f"{link.name}: {e}",), daemon=True).start()

    def send_control(self, kind: int, msg: Any) -> None:
        """A message every worker handles in order with the calls (ENGINE: the engine's setup)."""
        with self.call_lock:
            self.check()
            self._broadcast(kind, msg)

    def _ping_loop(self) -> None:
        while not self._closed and self.failure is None:
            time.sleep(self.heartbeat)
            self._broadcast(ch.PING, self.handles.take_dead())

    def _watchdog(self) -> None:
        while not self._closed and self.failure is None:
            time.sleep(0.25)
            if not self.serving:
                continue  # before compile() every first run compiles: only silence counts
            bound = STEP * self.timeout
            current = self._current
            if current is not None:
                n, path, t0 = current
                if path not in LONG_METHODS and time.monotonic() - t0 > bound:
                    behind = [
                        f"{w.name} in call {w.current[0]} ({w.current[1]})"
                        for w in self.workers.values()
                        if w.current is not None and w.current[0] != n
                    ]
                    where = f"; {', '.join(behind)}" if behind else ""
                    self.fail(f"call {n} ({path}) ran {bound:.1f}s on the leader without finishing{where}")
            for link in list(self.workers.values()):
                if link.current is not None:
                    n, path, seconds = link.current
                    if path not in LONG_METHODS and seconds > bound:
                        self.fail(f"{link.name} is stuck in call {n} ({path}) for {seconds:.1f}s")

    # ------------------------------------------------------------------ calls
    def call(self, path: str, method: Callable, args: tuple, kwargs: dict) -> Any:
        """Send the call to every worker, then run it here; every process runs calls in this order."""
        with self.call_lock:
            self.check()
            n = self._calls
            payload = wire.encode((n, path, args, kwargs, self.handles.take_dead()), self.handles.ref)
            self._calls += 1
            self._broadcast(ch.CALL, None, payload)
            self._current = (n, path, time.monotonic())
            outcome: str | None = None
            try:
                self.check()
                result = method(*args, **kwargs)
                self.retirement.push(result)  # a wedged device shows as this call not ending
            except BaseException as e:
                outcome = type(e).__name__
                raise
            finally:
                self._current = None
                with self._outcome_cv:
                    self._outcomes[n] = outcome
                    self._outcomes.pop(n - 4096, None)
                    self._outcome_cv.notify_all()
            self.handles.register(n, result)
            if path == "compile":
                self.serving = True
            return result

    def set_attribute(self, target: Any, name: str, value: Any) -> None:
        with self.call_lock:
            self.check()
            self._broadcast(ch.SETATTR, (name, value, self.handles.take_dead()))
            setattr(target, name, value)

    @property
    def calls(self) -> int:
        return self._calls

    # ------------------------------------------------------------------ the end
    def abort(self, reason: str, connect_wait: float) -> None:
        """A start-up error here: every worker is told, with the reason, and exits. Workers not connected
        yet are waited for (``connect_wait`` s: they joined the group with this process, so they are on
        their way), and each is given a moment to hang up, so that none outlives this process and dies
        in JAX's own abort without the reason."""
        deadline = time.monotonic() + connect_wait
        with self._joined:
            while set(self.workers) != self._expected and time.monotonic() < deadline:
                self._joined.wait(0.2)
        self.fail(reason)
        self.wait_gone(2.0)

    def wait_gone(self, seconds: float) -> None:
        """Until every connected worker has hung up (at most ``seconds``)."""
        deadline = time.monotonic() + seconds
        for link in list(self.workers.values()):
            link.gone.wait(max(0.0, deadline - time.monotonic()))

    def close(self, grace: float = 5.0) -> None:
        """A normal stop: tell the workers, wait (``grace`` s) for each to say goodbye, close the lane."""
        if self._closed:
            return
        if self.failure is None:
            self._broadcast(ch.STOP, None)
            deadline = time.monotonic() + grace
            for link in list(self.workers.values()):
                link.bye.wait(max(0.0, deadline - time.monotonic()))
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.close()
        for link in list(self.workers.values()):
            link.conn.close()


def heartbeat(timeout: float) -> float:
    """Seconds between beats: a second, or a tenth of the bound when that is shorter."""
    return min(HEARTBEAT_S, timeout / 10)


def _peer(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
