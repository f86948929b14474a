"""A worker's end of the step lane: connect to the leader, prove the secret, replay every call in order.

    main thread ─── load the model (phase "loading" -> "loaded"), build the engine from the leader's setup,
                    then the replay loop: each call, by path (engine_proxy.LANE_METHODS), in order
    reader ──────── frames from the leader: calls to the inbox; ABORT / a lost leader end the process
    beats ───────── BEAT every second (lane_leader.heartbeat): the phase, and where the replay loop is

The beat thread only reports what the replay loop stamps, so a wedged step shows as a call that does not
end (the leader's watchdog judges), a stopped or dead process as silence. A worker exits (never through
JAX's shutdown barrier, which would wait for the others): 0 when the leader says stop, 1 on its own error
or the leader's abort (the reason in its log either way), 3 when the leader is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..engines.host_arrays import put_host
from . import channel as ch
from . import wire
from .engine_proxy import build_engine, register_records, worker_method, worker_setattr
from .group import ProcessGroup, backoff
from .handles import Retirement, result_arrays
from .lane_leader import SILENCE, decode_plain, heartbeat
from .process_exit import exit_process

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_LEADER_GONE = 0, 1, 3


class LaneDiverged(RuntimeError):
    """A worker's engine no longer matches the leader's: it must exit (the group is recreated)."""


class WorkerLane:
    """A worker of ``group``; ``exit(code, reason)`` ends the process (a test in one process passes its own)."""

    def __init__(
        self,
        group: ProcessGroup,
        secret: bytes,
        timeout: float,
        exit: Callable[[int, str | None], Any] = exit_process,
        name: str = "",
        start_timeout: float = 1800.0,
    ):
        self.group, self.timeout = group, timeout
        self.start_timeout = start_timeout  # from connecting to the engine's setup (a slow leader loading)
        self._connected_at = time.monotonic()
        register_records()
        self._secret = secret
        self._exit = exit
        self.name = name or os.environ.get("POD_NAME", "") or socket.gethostname()
        self.engine: Any = None
        self.mesh: Any = None
        self.handles: dict[tuple[int, int], jax.Array] = {}
        self.calls = 0
        self.retirement = Retirement()
        self.phase = "connecting"
        self._current: tuple[int, str, float] | None = None
        self.conn: ch.Channel | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = threading.Event()

    def say(self, msg: str) -> None:
        print(f"[vsurge worker {self.group.process_id}] {msg}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ connecting
    def connect(self, timeout: float) -> None:
        """Reach the leader's lane (retrying with backoff: the leader binds it right after the group
        joins, but its pod may be slow) and authenticate; RuntimeError after ``timeout`` seconds."""
        host, port = self.group.lane_address()
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        for wait in backoff():
            try:
                sock = socket.create_connection((host, port), timeout=ch_timeout(deadline))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(max(1.0, min(30.0, deadline - time.monotonic())))
                self.conn = ch.worker_handshake(
                    sock, self._secret, self.group.process_id, self.group.num_processes, f"{host}:{port}"
                )
                break
            except ch.AuthError:
                raise
            except (OSError, ch.ChannelError) as e:
                last = e
            if time.monotonic() + wait > deadline:
                raise RuntimeError(
                    f"process {self.group.process_id}: no leader step lane at {host}:{port} after "
                    f"{timeout:.0f}s ({last})"
                )
            time.sleep(wait)
        self.conn.settimeout(SILENCE * self.timeout)
        self._connected_at = time.monotonic()
        self.phase = "loading"
        threading.Thread(target=self._read_loop, name="vsurge-lane-read", daemon=True).start()
        threading.Thread(target=self._beat_loop, name="vsurge-lane-beat", daemon=True).start()

    # ------------------------------------------------------------------ ending
    def end(self, code: int, why: str, report: bool = True) -> None:
        """Say why, then end the process (once); a failure's reason goes to the termination log unless
        ``report`` is False (the caller wrote a more precise one)."""
        if self._ended.is_set():
            return
        self._ended.set()
        self.say(why)
        if self.conn is not None and code != EXIT_OK:
            self.conn.close()
        self._exit(code, why.removesuffix("; exiting") if code and report else None)

    def abort(self, reason: str, error: BaseException | None = None) -> None:
        """An error here: tell the leader why (it ends the group), then exit 1. ``error``: this process's
        own exception, whose termination message (a ModelSourceError...) says more than the group's."""
        if self.conn is not None and not self._ended.is_set():
            with contextlib.suppress(ch.ChannelError):
                self.conn.send(ch.ERROR, wire.encode(reason, _no_device))
        if error is not None:
            from ..models.sources.errors import write_termination_log

            write_termination_log(error)
        self.end(EXIT_ERROR, f"{reason}; exiting", report=error is None)

    # ------------------------------------------------------------------ threads
    def _read_loop(self) -> None:
        while not self._ended.is_set():
            try:
                kind, payload = self.conn.recv()
            except TimeoutError:
                return self.end(
                    EXIT_LEADER_GONE,
                    f"heard nothing from the leader for {SILENCE * self.timeout:.1f}s; exiting",
                )
            except ch.ChannelError as e:
                return self.end(EXIT_LEADER_GONE, f"lost the leader's step lane ({e}); exiting")
            if kind == ch.PING:
                self._inbox.put((kind, payload))  # dead handles: dropped in order with the calls
            elif kind == ch.ABORT:
                try:
                    reason = decode_plain(payload)
                except wire.WireError as e:
                    reason = f"an unreadable abort ({e})"
                return self.end(EXIT_ERROR, f"the group failed: {reason}; exiting")
            elif kind in (ch.CALL, ch.SETATTR, ch.ENGINE):
                self._inbox.put((kind, payload))
            elif kind == ch.STOP:  # a normal stop: the leader hangs up once it has our goodbye
                self._inbox.put((kind, payload))
                return
            else:
                return self.abort(f"the leader sent a {ch.KINDS[kind]} frame (protocol error)")

    def _beat_loop(self) -> None:
        every = heartbeat(self.timeout)
        last = time.monotonic()
        while not self._ended.is_set():
            current = self._current
            where = None if current is None else (current[0], current[1], time.monotonic() - current[2])
            try:
                self.conn.send(ch.BEAT, wire.encode((self.phase, self.calls, where, self.name), _no_device))
            except ch.ChannelError as e:
                return self.end(EXIT_LEADER_GONE, f"lost the leader's step lane ({e}); exiting")
            time.sleep(every)
            late = time.monotonic() - last - every
            last = time.monotonic()
            if late > 0.25 * SILENCE * self.timeout:  # the process got no time to beat: say so
                self.say(
                    f"a beat came {late:.1f}s late ({self.phase}, call {self.calls}): is this host starved?"
                )

    # ------------------------------------------------------------------ replaying
    def loaded(self, mesh: Any) -> None:
        """The model is loaded: the leader may send the engine's setup."""
        self.mesh = mesh
        self.phase = "loaded"

    def run(self, model: Any, processor: Any) -> int:
        """Build the engine the leader describes, then replay its calls until it says stop (returns 0)."""
        while True:
            try:
                kind, payload = self._inbox.get(timeout=self._setup_wait())
            except queue.Empty:
                self.abort(f"the leader sent no engine setup within {self.start_timeout:.0f}s of connecting")
                return EXIT_ERROR
            try:
                if kind == ch.STOP:
                    self.phase = "stopped"
                    self._ended.set()  # the beats end here
                    with contextlib.suppress(ch.ChannelError):
                        self.conn.send(ch.BYE, wire.encode(None, _no_device))
                    self.say("the leader stopped; exiting")
                    return EXIT_OK
                msg = wire.decode(payload, self._handle, self._host_value)
                if kind == ch.PING:
                    self._drop(msg)
                elif kind == ch.ENGINE:
                    self._build(model, processor, msg)
                elif kind == ch.SETATTR:
                    name, value, dead = msg
                    self._drop(dead)
                    worker_setattr(self.engine, name, value)
                else:
                    self._call(*msg)
            except (wire.WireError, LaneDiverged, LookupError) as e:
                self.abort(f"diverged from the leader: {e}")
                return EXIT_ERROR
            except Exception as e:  # noqa: BLE001 - building the engine: the group cannot start
                self.abort(f"{type(e).__name__}: {e}")
                return EXIT_ERROR

    def _setup_wait(self) -> float | None:
        """How long the next message may take: bounded by the start timeout until the engine is built
        (a leader that beats but never finishes loading), then as long as it takes (idle serving)."""
        if self.engine is not None:
            return None
        return max(0.0, self._connected_at + self.start_timeout - time.monotonic())

    def _call(self, n: int, path: str, args: tuple, kwargs: dict, dead: list) -> None:
        self._drop(dead)
        if n != self.calls:
            raise LaneDiverged(f"call {n} arrived where call {self.calls} was due")
        if self.engine is None:
            raise LaneDiverged(f"call {n} ({path}) before the engine's setup")
        method = worker_method(self.engine, path)
        self._current = (n, path, time.monotonic())
        try:
            result = method(*args, **kwargs)
            self.retirement.push(result)  # a wedged device shows as this call not ending
        except Exception as e:  # noqa: BLE001 - the leader decides: the same error there is a bad request
            self.conn.send(
                ch.CALL_FAILED, wire.encode((n, path, f"{type(e).__name__}: {e}"[:500]), _no_device)
            )
            return
        finally:
            self._current = None
            self.calls = n + 1
        for i, arr in result_arrays(result):
            self.handles[(n, i)] = arr

    def _drop(self, dead: list) -> None:
        for h in dead:
            self.handles.pop(tuple(h), None)

    def _handle(self, h: wire.Handle) -> jax.Array:
        try:
            return self.handles[(h.call, h.leaf)]
        except KeyError:
            raise LaneDiverged(f"the leader named array {tuple(h)}, which this worker never made") from None

    def _host_value(self, v: wire.HostValue) -> jax.Array:
        if v.spec is None:
            return jax.device_put(v.value)
        return put_host(v.value, NamedSharding(self.engine.mesh, P(*v.spec)))

    def _build(self, model: Any, processor: Any, setup: dict[str, Any]) -> None:
        shape = dict(self.mesh.shape) if self.mesh is not None else None
        if setup.get("mesh") != shape:
            raise LaneDiverged(f"mesh {shape}, the leader's is {setup.get('mesh')}")
        config = setup["config"].replace(mesh=self.mesh)
        self.engine = build_engine(model, processor, config)
        want = setup.get("num_pages")
        if want is not None and self.engine.storage.num_pages != want:
            raise LaneDiverged(f"KV cache of {self.engine.storage.num_pages} pages, the leader has {want}")
        self.phase = "replaying"
        self.say(f"engine built ({config.driver}, mesh {shape}); replaying the leader")


def _no_device(x: Any) -> Any:
    raise wire.WireError("a worker's message cannot carry device arrays")


def ch_timeout(deadline: float) -> float:
    return max(1.0, min(10.0, deadline - time.monotonic()))
