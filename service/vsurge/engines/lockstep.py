"""One engine over the processes of a multi-host group: the leader's engine calls, replayed in lockstep.

    leader (process 0)                                    worker (process 1..N-1)
    HTTP, vSurge, driver threads                          no HTTP, no scheduler
        │ engine.decode(state) ...                            ▲
        ▼                                                     │ same method, same inputs, same order
    LeaderEngine ──(1) send ("call", n, "decode", args)──► step lane (TCP, length-prefixed pickles)
        │ (2) run it on the leader's engine                    │
        ▼                                                     ▼
    jitted programs on the global mesh  ◄═══ collectives ═══► the same programs on the worker's devices

Every process runs the same jitted programs on the same global inputs in the same order (SPMD). The lane
carries only host inputs: token ids, page tables, slots, sampling parameters. A device array in a call's
arguments that an earlier call produced (a prefix, the decode state) travels as a *handle*: result leaf
``i`` of call ``n`` is ``(n, i)`` on every process, because every process ran the same call. A device
array the driver made itself (oDriver's page table) travels as its host value and sharding. When the
leader's array is garbage-collected, its handle is dropped on the workers with the next message.

Calls are serialized by one lock on the leader (sent, then run), so the driver's threads (prefill,
generate) cannot order their programs differently on different processes. Reads to the host (tokens,
logprobs) happen on the leader only; the engines' outputs are replicated, so they need no collective.

Faults (``LANE_TIMEOUT_S``): the leader pings every ``HEARTBEAT_S`` and each worker answers with its own
heartbeat. A worker whose connection closes, or that sends nothing for LANE_TIMEOUT_S, breaks the lane:
every later engine call raises EngineUnavailableError, the server answers 503 ``engine_unavailable`` and
exits non-zero (``exit_on_failure``), so the LeaderWorkerSet recreates the group. A worker that hears
nothing from its leader for LANE_TIMEOUT_S (or sees the connection close) exits with a message saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import pickle
import socket
import struct
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..distributed import LANE_TIMEOUT_S, EngineUnavailableError, ProcessGroup, put_host
from ..request import RequestFailedError

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
EXIT_GRACE_S = 2.0  # after a failure, in-flight requests get their 503 before the leader exits
# Engine methods that only compute on the host from the engine's settings: run on the leader alone.
LOCAL_METHODS = frozenset(
    {
        "check_prompt",
        "needs_chunks",
        "bucket_for",
        "pack_rows_for",
        "decode_bucket",
        "rows_for",
        "entry_keys",
        "pages_bucket",
        "prefill_shapes",
        "get_state_shardings",
        "get_prefix_destination_sharding",
    }
)
_FRAME = struct.Struct("!Q")


# ------------------------------------------------------------------------------------ framing


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_FRAME.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    return _recv_exact(sock, n)


def _is_callback(obj: Any) -> bool:
    """A callback in a call's arguments (compile's progress): local functions, bound methods, partials.
    Module-level functions and builtins (pickle's own reconstructors) pickle by name and stay."""
    if isinstance(obj, types.FunctionType):
        return "<" in obj.__qualname__
    return isinstance(obj, types.MethodType | partial)


class _Encoder(pickle.Pickler):
    """Pickles a call's arguments; device arrays become handles or host values, callbacks None."""

    def __init__(self, buf: io.BytesIO, lane: LeaderLane):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.lane = lane

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, jax.Array):
            handle = self.lane.handle_of(obj)
            if handle is not None:
                return ("h", handle)
            sharding = obj.sharding
            spec = sharding.spec if isinstance(sharding, NamedSharding) else None
            return ("v", np.asarray(obj), spec)
        if _is_callback(obj):
            return ("none",)  # progress callbacks: the workers' own logs say enough
        return None


class _Decoder(pickle.Unpickler):
    def __init__(self, data: bytes, worker: Worker):
        super().__init__(io.BytesIO(data))
        self.worker = worker

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "h":
            try:
                return self.worker.handles[pid[1]]
            except KeyError:
                raise LaneDiverged(f"the leader named array {pid[1]}, which this worker never made") from None
        if kind == "v":
            _, value, spec = pid
            mesh = self.worker.engine.mesh
            if spec is None:
                return jax.device_put(value)
            return put_host(value, NamedSharding(mesh, spec))
        return None


class LaneDiverged(RuntimeError):
    """A worker's engine no longer matches the leader's: it must exit (the group is recreated)."""


def _result_arrays(result: Any) -> list[tuple[int, jax.Array]]:
    return [(i, x) for i, x in enumerate(jax.tree_util.tree_leaves(result)) if isinstance(x, jax.Array)]


# ------------------------------------------------------------------------------------ leader


class LeaderLane:
    """The leader's end: accepts the workers, sends every engine call, watches their heartbeats."""

    def __init__(self, group: ProcessGroup, host: str = "0.0.0.0"):
        self.group = group
        _, port = group.lane_address()
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.settimeout(0.5)
        self._workers: dict[int, socket.socket] = {}
        self._send_lock = threading.Lock()
        self.call_lock = threading.RLock()
        self._calls = 0
        self._known: dict[int, tuple[list, weakref.ref]] = {}  # id(array) -> ([handle], weakref)
        self._dead: list[list] = []  # handle cells of collected arrays, dropped with the next message
        self._last_sent = time.monotonic()
        self.failure: str | None = None
        self._failed = threading.Event()
        self._callbacks: list[Callable[[str], None]] = []
        self._closed = False

    # ------------------------------------------------------------------ start
    def accept(self, timeout: float) -> None:
        """Wait for every worker to connect (each says its process id), then start the heartbeats."""
        want = set(range(1, self.group.num_processes))
        deadline = time.monotonic() + timeout
        while want - set(self._workers):
            if time.monotonic() > deadline:
                missing = sorted(want - set(self._workers))
                raise EngineUnavailableError(
                    f"workers {missing} did not connect to the step lane within {timeout:.0f}s"
                )
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(timeout)
            hello = pickle.loads(recv_frame(conn))
            if hello[0] != "hello" or hello[1] not in want:
                conn.close()
                continue
            conn.settimeout(LANE_TIMEOUT_S)
            self._workers[hello[1]] = conn
        self._server.close()
        for pid, conn in self._workers.items():
            threading.Thread(
                target=self._watch, args=(pid, conn), name=f"vsurge-lane-watch-{pid}", daemon=True
            ).start()
        threading.Thread(target=self._ping_loop, name="vsurge-lane-ping", daemon=True).start()

    # ------------------------------------------------------------------ faults
    def on_failure(self, fn: Callable[[str], None]) -> Callable[[], None]:
        """Call ``fn(reason)`` once the lane breaks (at once if it is broken); returns its remover."""
        self._callbacks.append(fn)
        if self.failure is not None:
            fn(self.failure)
        return lambda: self._callbacks.remove(fn) if fn in self._callbacks else None

    def fail(self, reason: str) -> None:
        with self._send_lock:
            if self.failure is not None or self._closed:
                return
            self.failure = reason
        log.error("multi-host engine unavailable: %s", reason)
        print(f"[vsurge] multi-host engine unavailable: {reason}", file=sys.stderr, flush=True)
        self._failed.set()
        for fn in list(self._callbacks):
            try:
                fn(reason)
            except Exception:
                log.exception("failure callback")

    def wait_failed(self, timeout: float) -> bool:
        return self._failed.wait(timeout)

    def check(self) -> None:
        if self.failure is not None:
            raise EngineUnavailableError(f"a process of the multi-host group is gone ({self.failure})")

    def _watch(self, pid: int, conn: socket.socket) -> None:
        while not self._closed and self.failure is None:
            try:
                msg = pickle.loads(recv_frame(conn))
            except TimeoutError:
                self.fail(f"worker {pid} sent no heartbeat for {LANE_TIMEOUT_S:.0f}s (hung?)")
                return
            except (OSError, ConnectionError, EOFError, pickle.UnpicklingError):
                if not self._closed:
                    self.fail(f"worker {pid} closed the step lane (the process died?)")
                return
            if msg[0] == "error":
                self.fail(f"worker {pid}: {msg[1]}")
                return

    def _ping_loop(self) -> None:
        while not self._closed and self.failure is None:
            time.sleep(HEARTBEAT_S / 2)
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                self._send(("ping", self._take_dead()))

    # ------------------------------------------------------------------ sending
    def _send(self, msg: Any, data: bytes | None = None) -> None:
        data = data if data is not None else pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self.failure is not None or self._closed:
                return
            for pid, conn in self._workers.items():
                try:
                    send_frame(conn, data)
                except OSError as e:
                    threading.Thread(
                        target=self.fail, args=(f"worker {pid}: sending failed ({e})",), daemon=True
                    ).start()
                    return
            self._last_sent = time.monotonic()

    def _take_dead(self) -> list:
        dead, self._dead = self._dead, []
        return [cell[0] for cell in dead]

    def handle_of(self, arr: jax.Array) -> tuple[int, int] | None:
        entry = self._known.get(id(arr))
        if entry is None or entry[1]() is not arr:
            return None
        return entry[0][0]

    def _register(self, n: int, result: Any) -> None:
        for i, arr in _result_arrays(result):
            entry = self._known.get(id(arr))
            if entry is not None and entry[1]() is arr:
                self._dead.append([entry[0][0]])  # known under an older handle: that one goes
                entry[0][0] = (n, i)
                continue
            cell = [(n, i)]
            key = id(arr)

            def collected(_ref: Any, cell: list = cell, key: int = key) -> None:
                self._dead.append(cell)
                entry = self._known.get(key)
                if entry is not None and entry[0] is cell:
                    del self._known[key]

            self._known[key] = (cell, weakref.ref(arr, collected))

    def call(self, target: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        """Send the call to every worker, then run it here; every process runs calls in this order."""
        with self.call_lock:
            self.check()
            buf = io.BytesIO()
            _Encoder(buf, self).dump(("call", name, args, kwargs, self._take_dead()))
            n = self._calls
            self._calls += 1
            self._send(None, buf.getvalue())
            self.check()
            result = getattr(target, name)(*args, **kwargs)
            self._register(n, result)
            return result

    def set_attribute(self, target: Any, name: str, value: Any) -> None:
        with self.call_lock:
            buf = io.BytesIO()
            _Encoder(buf, self).dump(("setattr", name, value, self._take_dead()))
            self._send(None, buf.getvalue())
            setattr(target, name, value)

    def close(self) -> None:
        """Tell the workers to exit (a normal stop), then close the lane."""
        if self._closed:
            return
        self._send(("stop",))
        self._closed = True
        with self._send_lock:
            for conn in self._workers.values():
                with contextlib.suppress(OSError):
                    conn.close()


class LeaderEngine:
    """The leader's engine as the driver sees it: every public method that runs programs goes through
    the lane first; attributes, properties and host-only helpers (LOCAL_METHODS) read the real engine."""

    def __init__(self, engine: Any, lane: LeaderLane):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_lane", lane)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if name.startswith("_") or name in LOCAL_METHODS or not isinstance(value, types.MethodType):
            return value
        return partial(self._lane.call, self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._lane.set_attribute(self._engine, name, value)

    @property
    def engine(self) -> Any:
        return self._engine


def engine_setup(engine: Any, config: Any) -> dict[str, Any]:
    """What a worker needs to build the same engine: the config (the mesh as its spec), with the KV
    cache's size fixed to the leader's page count (free memory differs a little from host to host)."""
    setup: dict[str, Any] = {"config": config, "mesh": dict(engine.mesh.shape) if engine.mesh else None}
    storage = getattr(engine, "storage", None)
    if storage is not None:
        setup["config"] = config.replace(kv_cache_bytes=int(storage.nbytes))
        setup["num_pages"] = int(storage.num_pages)
    return setup


def build_engine(model: Any, processor: Any, config: Any) -> Any:
    if config.driver == "odriver":
        from .oengine import oEngine

        return oEngine(model, processor, config)
    from .vengine import vEngine

    return vEngine(model, processor, config)


class LockstepSurge:
    """The leader's vSurge, with what a broken group means for the server: ``live`` turns False
    (readiness and liveness fail) and every stream, new or in flight, ends with EngineUnavailableError."""

    def __init__(self, surge: Any, lane: LeaderLane):
        self._surge = surge
        self._lane = lane

    def __getattr__(self, name: str) -> Any:
        return getattr(self._surge, name)

    @property
    def live(self) -> bool:
        return self._lane.failure is None and self._surge.live

    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        return self._surge.compile(progress)

    def stop(self) -> None:
        try:
            if self._lane.failure is None:
                self._surge.stop()
        finally:
            self._lane.close()

    def _unavailable(self) -> EngineUnavailableError:
        return EngineUnavailableError(f"a process of the multi-host group is gone ({self._lane.failure})")

    async def complete(self, request: Any):
        if self._lane.failure is not None:
            raise self._unavailable()
        loop = asyncio.get_running_loop()
        failed = asyncio.Event()
        forget = self._lane.on_failure(lambda _reason: loop.call_soon_threadsafe(failed.set))
        agen = self._surge.complete(request)
        waiter = asyncio.ensure_future(failed.wait())
        try:
            while True:
                step = asyncio.ensure_future(agen.__anext__())
                await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the group broke while this request waited for tokens
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                    raise self._unavailable()
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                except RequestFailedError:
                    # a device step failed because a peer went away: say so, not "request failed"
                    if await asyncio.to_thread(self._lane.wait_failed, 2.0):
                        raise self._unavailable() from None
                    raise
                yield item
        finally:
            forget()
            waiter.cancel()
            await agen.aclose()


def leader_surge(
    model: Any, processor: Any, config: Any, lane: LeaderLane, *, name: str | None = None
) -> LockstepSurge:
    """The leader's vSurge over a LeaderEngine: the driver config.driver names, as vSurge.create builds it."""
    from ..drivers.vdriver import vDriver
    from ..surge import vSurge

    engine = build_engine(model, processor, config)
    spec = config.mesh if isinstance(config.mesh, str) else None
    lane.call_lock.acquire()
    try:
        lane._send(("engine", engine_setup(engine, config.replace(mesh=spec))))
    finally:
        lane.call_lock.release()
    proxy = LeaderEngine(engine, lane)
    if config.driver == "odriver":
        from ..drivers.odriver import oDriver

        driver = oDriver(
            proxy, detokenizing_blocks=config.detokenizing_blocks, max_queue_size=config.max_queue_size
        )
    else:
        driver = vDriver(
            proxy,
            proxy,
            interleaved_mode=config.interleaved_mode,
            detokenizing_blocks=config.detokenizing_blocks,
            max_queue_size=config.max_queue_size,
            max_decode_stall=config.max_decode_stall,
        )
    return LockstepSurge(vSurge(driver, name), lane)


def exit_on_failure(lane: LeaderLane, api: Any, grace: float = EXIT_GRACE_S) -> None:
    """Once the lane breaks: in-flight requests get their 503 (``grace`` seconds), then the server stops
    with an error (exit status 1); a hard exit 5 s later if a device call or JAX's shutdown still waits for
    the dead peer."""

    def stop(reason: str) -> None:
        def later() -> None:
            time.sleep(grace)
            api.fatal = EngineUnavailableError(f"a process of the multi-host group is gone ({reason})")
            time.sleep(5.0)
            print("[vsurge] exiting: a process of the multi-host group is gone", file=sys.stderr, flush=True)
            os._exit(1)

        threading.Thread(target=later, name="vsurge-lane-exit", daemon=True).start()

    lane.on_failure(stop)


# ------------------------------------------------------------------------------------ worker


class Worker:
    """A worker's end: connects to the leader's lane, builds the same engine, replays every call."""

    def __init__(
        self,
        group: ProcessGroup,
        model: Any,
        processor: Any,
        mesh: Any,
        exit: Callable[[int], Any] = os._exit,
    ):
        self.group = group
        self._exit = exit  # the process's end (a test in one process passes its own)
        self.model, self.processor, self.mesh = model, processor, mesh
        self.engine: Any = None
        self.handles: dict[tuple[int, int], jax.Array] = {}
        self._calls = 0
        self._sock: socket.socket | None = None
        self._inbox: list[bytes] = []
        self._cv = threading.Condition()
        self._closed = False

    def _say(self, msg: str) -> None:
        print(f"[vsurge worker {self.group.process_id}] {msg}", file=sys.stderr, flush=True)

    def connect(self, timeout: float) -> None:
        host, port = self.group.lane_address()
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as e:
                last = e
                time.sleep(0.5)
        else:
            raise EngineUnavailableError(
                f"process {self.group.process_id}: no leader step lane at {host}:{port} after "
                f"{timeout:.0f}s ({last})"
            )
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, pickle.dumps(("hello", self.group.process_id)))
        sock.settimeout(LANE_TIMEOUT_S)
        self._sock = sock
        threading.Thread(target=self._read_loop, name="vsurge-lane-read", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="vsurge-lane-beat", daemon=True).start()

    def _lost(self, why: str) -> None:
        if self._closed:
            return
        self._say(f"lost the leader's step lane ({why}); exiting")
        self._closed = True
        self._exit(3)

    def _read_loop(self) -> None:
        while not self._closed:
            try:
                data = recv_frame(self._sock)
            except TimeoutError:
                return self._lost(f"nothing heard for {LANE_TIMEOUT_S:.0f}s")
            except (OSError, ConnectionError) as e:
                return self._lost(str(e) or type(e).__name__)
            with self._cv:
                self._inbox.append(data)
                self._cv.notify()

    def _heartbeat_loop(self) -> None:
        beat = pickle.dumps(("alive",))
        while not self._closed:
            try:
                send_frame(self._sock, beat)
            except OSError as e:
                return self._lost(str(e))
            time.sleep(HEARTBEAT_S)

    def _next(self) -> bytes:
        with self._cv:
            while not self._inbox:
                self._cv.wait()
            return self._inbox.pop(0)

    def _drop(self, dead: list) -> None:
        for h in dead:
            self.handles.pop(tuple(h), None)

    def run(self) -> int:
        """Replay the leader's calls until it says stop (0); diverging from it is an error (exit 1)."""
        while True:
            data = self._next()
            if data[:1] != b"\x80":  # not a pickle: cannot happen on a well-formed lane
                raise LaneDiverged("malformed message on the step lane")
            try:
                msg = _Decoder(data, self).load()
            except LaneDiverged as e:
                self._fatal(str(e))
                return 1
            kind = msg[0]
            if kind == "ping":
                self._drop(msg[1])
            elif kind == "stop":
                self._closed = True
                self._say("the leader stopped; exiting")
                return 0
            elif kind == "engine":
                self._build(msg[1])
            elif kind == "setattr":
                _, name, value, dead = msg
                self._drop(dead)
                setattr(self.engine, name, value)
            elif kind == "call":
                _, name, args, kwargs, dead = msg
                self._drop(dead)
                n = self._calls
                self._calls += 1
                try:
                    result = getattr(self.engine, name)(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - the leader raised the same (a bad request)
                    log.info("call %d %s raised %s: %s (as on the leader)", n, name, type(e).__name__, e)
                    continue
                for i, arr in _result_arrays(result):
                    self.handles[(n, i)] = arr
                del result

    def _build(self, setup: dict[str, Any]) -> None:
        shape = dict(self.mesh.shape) if self.mesh is not None else None
        if setup.get("mesh") != shape:
            self._fatal(f"mesh {shape}, the leader's is {setup.get('mesh')}")
        config = setup["config"].replace(mesh=self.mesh)
        self.engine = build_engine(self.model, self.processor, config)
        want = setup.get("num_pages")
        if want is not None and self.engine.storage.num_pages != want:
            self._fatal(f"KV cache of {self.engine.storage.num_pages} pages, the leader has {want}")
        self._say(f"engine built ({config.driver}, mesh {shape}); replaying the leader")

    def _fatal(self, reason: str) -> None:
        self._say(f"diverged from the leader: {reason}; exiting")
        self.abort(reason)

    def abort(self, reason: str) -> None:
        """Tell the leader why, and exit at once (JAX's shutdown barrier would wait for the others)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                send_frame(self._sock, pickle.dumps(("error", reason)))
            with contextlib.suppress(OSError):
                self._sock.close()
        self._exit(1)
