"""The step lane in one process: its value format, its authenticated channel, and a leader and a worker
engine joined by a real lane on loopback (one device each, no collectives). Fast: no JAX group, no compile
beyond one tiny engine."""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from multihost_group import free_port

from vsurge.multihost import channel as ch
from vsurge.multihost import wire
from vsurge.multihost.engine_proxy import (
    LaneRefused,
    LeaderEngine,
    build_engine,
    engine_setup,
    register_records,
)
from vsurge.multihost.group import ProcessGroup
from vsurge.multihost.lane_leader import SILENCE, LeaderLane
from vsurge.multihost.lane_worker import WorkerLane
from vsurge.request import EngineUnavailableError
from vsurge.sampling_params import SamplingParams

SECRET = b"0123456789abcdef0123456789abcdef-group"
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 61, 88, 12, 250, 9]]
MAX_TOKENS = 8


# ------------------------------------------------------------------------------------ the format


def _no_arrays(_):
    raise AssertionError("no device arrays here")


def _roundtrip(value):
    register_records()
    return wire.decode(wire.encode(value, _no_arrays), _no_arrays, _no_arrays)


def test_values_cross_the_lane_as_they_left():
    from vsurge.engines.dense_mixed import Chunk

    arrays = [
        np.arange(6).astype(d).reshape(2, 3)
        for d in ("int32", "uint32", "float32", "int64", "bool", ml_dtypes.bfloat16)
    ]
    value = {
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 + 5, -(2**70)],
        "floats": (0.5, float("inf")),
        "text": "héllo",
        "raw": b"\x00\x01",
        "none": None,
        "flags": [True, False],
        "arrays": arrays,
        "scalar": np.int32(7),
        "chunk": Chunk(3, 16, np.array([1, 2, 3], np.int32)),
        3: "an int key",
    }
    back = _roundtrip(value)
    assert back["ints"] == value["ints"] and back["floats"] == value["floats"] and back[3] == "an int key"
    assert back["text"] == "héllo" and back["raw"] == b"\x00\x01" and back["none"] is None
    for a, b in zip(arrays, back["arrays"], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert back["scalar"] == 7 and back["scalar"].dtype == np.int32
    assert type(back["chunk"]) is Chunk and back["chunk"].slot == 3
    params = SamplingParams(
        temperature=0.7, seed=2**64 - 1, stop=["x"], logit_bias={5: -100.0}, grammar=object()
    )
    got = _roundtrip(params)
    # the grammar stays on the leader (the masks cross): the workers know only that there is one
    assert got.grammar is True and got.seed == 2**64 - 1 and got.logit_bias == {5: -100.0}


def test_bytes_that_are_not_a_value_are_refused_never_run(tmp_path):
    register_records()
    good = wire.encode({"a": [1, np.zeros(3, np.float32)], "b": SamplingParams()}, _no_arrays)
    for n in range(len(good)):  # every truncation
        with pytest.raises(wire.WireError):
            wire.decode(good[:n], _no_arrays, _no_arrays)
    with pytest.raises(wire.WireError):
        wire.decode(good + b"\x00", _no_arrays, _no_arrays)

    class Boom:
        def __reduce__(self):
            return (Path(tmp_path / "pwned").write_text, ("owned",))

    for payload in (pickle.dumps(Boom()), pickle.dumps(Boom(), protocol=0), b"\x0f\x04Boom\x00\x00\x00\x00"):
        with pytest.raises(wire.WireError):
            wire.decode(payload, _no_arrays, _no_arrays)
    assert not (tmp_path / "pwned").exists()
    # a length that claims more than the frame holds is refused before anything is allocated
    with pytest.raises(wire.WireError):
        wire.decode(bytes([8]) + struct.pack("!I", 2**31), _no_arrays, _no_arrays)
    with pytest.raises(wire.WireError, match="does not cross"):
        wire.encode(object(), _no_arrays)


# ------------------------------------------------------------------------------------ the channel


def _pair():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    server.close()
    for s in (client, conn):
        s.settimeout(5)
    return conn, client


def _handshake(leader_secret=SECRET, worker_secret=SECRET, pid=1, allowed=frozenset({1})):
    conn, client = _pair()
    out = {}

    def lead():
        try:
            out["leader"] = ch.leader_handshake(conn, leader_secret, 2, set(allowed), "worker")
        except ch.ChannelError as e:
            out["leader_error"] = e
            conn.close()

    t = threading.Thread(target=lead)
    t.start()
    try:
        out["worker"] = ch.worker_handshake(client, worker_secret, pid, 2, "leader")
    except ch.ChannelError as e:
        out["worker_error"] = e
    t.join()
    return out


def test_the_handshake_proves_the_secret_both_ways():
    ok = _handshake()
    pid, leader = ok["leader"]
    worker = ok["worker"]
    assert pid == 1
    worker.send(ch.BEAT, b"hi")
    assert leader.recv() == (ch.BEAT, b"hi")
    leader.send(ch.CALL, b"x" * 100)
    assert worker.recv() == (ch.CALL, b"x" * 100)

    bad = _handshake(worker_secret=b"w" * 40)
    assert "wrong proof" in str(bad["leader_error"]) and "worker" not in bad
    fake_leader = _handshake(leader_secret=b"w" * 40)
    assert "leader_error" in fake_leader and "worker_error" in fake_leader
    taken = _handshake(allowed=frozenset())  # the secret is right, but process 1 is connected already
    assert "not a worker of this group waiting" in str(taken["leader_error"])


def test_an_auth_frame_replayed_on_a_new_connection_is_refused():
    conn, client = _pair()
    client = Recorder(client)
    t = threading.Thread(target=lambda: ch.leader_handshake(conn, SECRET, 2, {1}, "w"))
    t.start()
    ch.worker_handshake(client, SECRET, 1, 2, "leader")
    t.join()
    auth = client.sent[0]
    conn2, client2 = _pair()
    err = {}
    t = threading.Thread(
        target=lambda: err.setdefault("e", _catch(ch.leader_handshake, conn2, SECRET, 2, {1}, "w"))
    )
    t.start()
    client2.recv(4096)  # the new HELLO: a fresh nonce
    client2.sendall(auth)
    t.join()
    assert isinstance(err["e"], ch.AuthError) and "wrong proof" in str(err["e"])


class Recorder:
    """A socket whose sends are kept (and passed on unless ``forward`` is False)."""

    def __init__(self, sock, forward: bool = True):
        self.sock, self.forward, self.sent = sock, forward, []

    def sendall(self, data):
        self.sent.append(bytes(data))
        if self.forward:
            self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _catch(fn, *args):
    try:
        fn(*args)
    except ch.ChannelError as e:
        return e
    return None


def _tapped():
    """A connected (leader channel, worker channel) whose worker sends are kept, not sent."""
    ok = _handshake()
    _, leader = ok["leader"]
    worker = ok["worker"]
    real = worker.sock
    worker.sock = Recorder(real, forward=False)
    return leader, worker, real


def test_frames_that_were_replayed_altered_or_cut_break_the_connection():
    leader, worker, real = _tapped()
    worker.send(ch.BEAT, b"one")
    real.sendall(worker.sock.sent[0])
    assert leader.recv() == (ch.BEAT, b"one")
    real.sendall(worker.sock.sent[0])  # the same frame again: its sequence number is spent
    with pytest.raises(ch.ChannelError, match="sequence 0, expected 1"):
        leader.recv()

    leader, worker, real = _tapped()
    worker.send(ch.BEAT, b"payload")
    frame = bytearray(worker.sock.sent[0])
    frame[-40] ^= 1  # one bit of the payload
    real.sendall(bytes(frame))
    with pytest.raises(ch.ChannelError, match="failed its MAC"):
        leader.recv()

    leader, worker, real = _tapped()
    worker.send(ch.BEAT, b"payload")
    real.sendall(worker.sock.sent[0][:-10])  # cut short, then the sender is gone
    real.shutdown(socket.SHUT_WR)
    with pytest.raises(ch.ChannelError, match="closed inside a frame"):
        leader.recv()

    leader, worker, real = _tapped()
    real.sendall(b"VSLN" + struct.pack("!BBHQI", 1, ch.BEAT, 0, 0, 2**31))  # claims 2 GiB
    with pytest.raises(ch.ChannelError, match="exceeds the limit"):
        leader.recv()

    leader, worker, real = _tapped()
    real.sendall(b"VSLN" + struct.pack("!BBHQI", ch.VERSION + 1, ch.BEAT, 0, 0, 0) + bytes(ch.MAC_SIZE))
    with pytest.raises(ch.ChannelError, match=f"protocol version {ch.VERSION + 1}"):
        leader.recv()


def test_a_missing_or_short_secret_is_refused(tmp_path):
    with pytest.raises(ch.SecretError, match="VSURGE_LANE_SECRET_FILE"):
        ch.read_secret({})
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ch.SecretError, match="at least 32"):
        ch.read_secret({"VSURGE_LANE_SECRET_FILE": str(short)})
    with pytest.raises(ch.SecretError, match="cannot read"):
        ch.read_secret({"VSURGE_LANE_SECRET_FILE": str(tmp_path / "absent")})
    good = tmp_path / "good"
    good.write_text("k" * 40 + "\n")
    assert ch.read_secret({"VSURGE_LANE_SECRET_FILE": str(good)}) == b"k" * 40


# ------------------------------------------------------------------------------------ leader and worker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama of the multi-host tests and its single-process greedy reference."""
    from tiny_models import make_checkpoint

    import vsurge
    from vsurge.models.reference import greedy_by_recompute

    d = tmp_path_factory.mktemp("lane-ckpt")
    make_checkpoint(d, "llama", heads=8, kv_heads=8, hidden=64, layers=2)
    model, tok = vsurge.load_model(str(d))
    return model, tok, [greedy_by_recompute(model, p, MAX_TOKENS) for p in PROMPTS]


class Tap:
    """A TCP relay between a worker and its leader that keeps the leader's frames (split at their
    boundaries) and can put a copy of one back into the stream."""

    HEADER = struct.Struct("!4sBBHQI")

    def __init__(self, leader_port: int):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.leader_port = leader_port
        self.frames: list[bytes] = []
        self.inject: list[bytes] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        w, _ = self.server.accept()
        lead = socket.create_connection(("127.0.0.1", self.leader_port))
        threading.Thread(target=self._pipe, args=(w, lead), daemon=True).start()
        try:
            while True:
                header = self._exact(lead, self.HEADER.size)
                frame = header + self._exact(lead, self.HEADER.unpack(header)[5] + ch.MAC_SIZE)
                self.frames.append(frame)
                while self.inject:
                    w.sendall(self.inject.pop(0))
                w.sendall(frame)
        except OSError:
            w.close()

    @staticmethod
    def _exact(sock, n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise OSError("closed")
            buf += chunk
        return buf

    @staticmethod
    def _pipe(src, dst):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                dst.close()
                return
            dst.sendall(data)


class Pair:
    """A LeaderLane and a WorkerLane in this process; the worker's exits are recorded, not taken. With
    ``tap`` the worker reaches its leader through a Tap."""

    def __init__(self, model, tok, timeout: float = 10.0, tap: bool = False):
        port = free_port()
        self.group = ProcessGroup(f"127.0.0.1:{port - 1}", 2, 0, "options")
        self.lane = LeaderLane(self.group, SECRET, timeout, host="127.0.0.1")
        self.lane.start()
        self.tap = Tap(port) if tap else None
        wport = self.tap.port if tap else port
        self.exits: list[tuple[int, str | None]] = []
        self.worker = WorkerLane(
            ProcessGroup(f"127.0.0.1:{wport - 1}", 2, 1, "options"),
            SECRET,
            timeout,
            exit=lambda code, why: self.exits.append((code, why)),
            name="test-worker",
        )
        self.done: dict = {}
        self.model, self.tok = model, tok

    def start_worker(self) -> None:
        def work():
            self.worker.connect(30)
            self.worker.loaded(None)
            self.done["rc"] = self.worker.run(self.model, self.tok)

        threading.Thread(target=work, daemon=True).start()

    def engine(self):
        from vsurge.engine_config import EngineConfig

        self.lane.wait_workers("loaded", 60, "load")
        config = EngineConfig(max_concurrent_decodes=2, max_length=64, prefill_lengths=(32,))
        engine = build_engine(self.model, self.tok, config)
        self.lane.send_control(ch.ENGINE, engine_setup(engine, config))
        return LeaderEngine(engine, self.lane)


def _generate(proxy):
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
    return rows, state


def test_the_worker_replays_every_call_and_a_silent_worker_breaks_the_lane(tiny):
    """The worker's engine, fed only what crosses the lane, makes the leader's tokens; a worker that goes
    silent breaks the lane within its bound and every later call says so."""
    import jax

    model, tok, reference = tiny
    pair = Pair(model, tok)
    pair.start_worker()
    proxy = pair.engine()
    rows, state = _generate(proxy)
    assert rows == reference and not pair.exits
    n = pair.lane.calls - 1  # the last decode: its result leaves are handles (n, i) on the worker
    leaves = jax.tree_util.tree_leaves(state)
    tokens_index = next(i for i, x in enumerate(leaves) if x is state.tokens)
    deadline = time.monotonic() + 30
    while pair.worker.calls <= n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert np.array_equal(np.asarray(pair.worker.handles[(n, tokens_index)]), np.asarray(state.tokens))
    assert proxy.check_prompt([1, 2, 3]) == 3 and pair.lane.calls == n + 1  # host-only: not sent
    assert pair.lane.workers[1].name == "worker 1 (test-worker)" and pair.lane.workers[1].phase == "replaying"

    # what could reach device state behind the lane's back is refused, by name
    with pytest.raises(LaneRefused, match="'params'"):
        _ = proxy.params
    with pytest.raises(LaneRefused, match="'chunked'"):
        _ = proxy.chunked
    with pytest.raises(LaneRefused, match="setting engine attribute '_pos'"):
        proxy._pos = None

    # the worker goes silent (its beats and its reader stop, as under SIGSTOP)
    pair.worker._ended.set()
    t0 = time.monotonic()
    assert pair.lane.wait_failed(SILENCE * pair.lane.timeout + 5), "the lane did not notice a silent worker"
    took = time.monotonic() - t0
    assert took <= pair.lane.timeout, took
    assert "worker 1 (test-worker) sent nothing" in pair.lane.failure
    with pytest.raises(EngineUnavailableError, match="worker 1"):
        proxy.decode(state)
    pair.lane.close()


def test_unseeded_sampling_draws_the_same_on_leader_and_worker(tiny):
    """An unseeded sampled prompt inserted without an explicit key: the engines on both ends sample the
    same tokens (no engine draws a key from its own process's entropy); the request's own key, passed
    explicitly as the drivers do, is the same on both ends too."""
    import jax

    model, tok, _ = tiny
    pair = Pair(model, tok)
    pair.start_worker()
    proxy = pair.engine()
    hot = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    state = proxy.init_decode_state()
    state, _ = proxy.insert(proxy.prefill(PROMPTS[0], hot), state, 0, length=len(PROMPTS[0]))
    key = np.array([12345, 678], np.uint32)  # what ActiveRequest drew for the request, on the leader
    state, _ = proxy.insert(proxy.prefill(PROMPTS[1], hot), state, 1, key=key, length=len(PROMPTS[1]))
    for _ in range(4):
        state, out = proxy.decode(state)
    n = pair.lane.calls - 1
    leaves = jax.tree_util.tree_leaves(state)
    i = next(i for i, x in enumerate(leaves) if x is state.tokens)
    deadline = time.monotonic() + 30
    while pair.worker.calls <= n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert np.array_equal(np.asarray(pair.worker.handles[(n, i)]), np.asarray(state.tokens))
    assert not pair.exits
    pair.lane.close()


def test_a_slow_leader_is_waited_for_while_it_beats(tiny):
    """The leader takes three times the silence bound to load: its worker, connected and beating, waits
    (bounded by the start timeout, not the lane's) and then replays."""
    model, tok, reference = tiny
    pair = Pair(model, tok, timeout=4.0)
    pair.start_worker()
    pair.lane.wait_workers("loaded", 60, "load")
    time.sleep(3 * SILENCE * 4.0)  # the leader "compiles"
    assert not pair.exits and pair.lane.failure is None
    rows, _ = _generate(pair.engine())
    assert rows == reference and not pair.exits
    pair.lane.close()
    deadline = time.monotonic() + 10
    while "rc" not in pair.done and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pair.done.get("rc") == 0  # a normal stop: the worker said goodbye and ends with 0


def test_a_leader_that_never_finishes_loading_ends_at_the_start_timeout(tiny):
    """A leader that beats but never sends the engine's setup: its worker gives up at the start timeout,
    says why, and the leader's lane fails with that reason (a bounded start, not a hang)."""
    model, tok, _ = tiny
    pair = Pair(model, tok)
    pair.worker.start_timeout = 2.0
    pair.start_worker()
    assert pair.lane.wait_failed(30), "the start was not bounded"
    assert pair.exits and pair.exits[0][0] == 1 and "no engine setup within 2s" in pair.exits[0][1]
    assert "no engine setup within 2s" in pair.lane.failure
    pair.lane.close()


def test_a_failure_seen_only_by_the_worker_ends_the_group(tiny):
    """The worker loses an array the leader names (its state no longer matches): it tells the leader why
    and exits 1; the leader's lane fails with that reason instead of waiting on a peer that is gone."""
    model, tok, _ = tiny
    pair = Pair(model, tok)
    pair.start_worker()
    proxy = pair.engine()
    state = proxy.init_decode_state()
    deadline = time.monotonic() + 30
    while not pair.worker.handles and time.monotonic() < deadline:
        time.sleep(0.05)
    pair.worker.handles.clear()
    with pytest.raises(EngineUnavailableError):
        for _ in range(50):
            state, _ = proxy.decode(state)
            time.sleep(0.05)
    assert pair.exits and pair.exits[0][0] == 1 and "never made" in pair.exits[0][1]
    assert "diverged from the leader" in pair.lane.failure and "never made" in pair.lane.failure
    pair.lane.close()


def test_a_frame_replayed_into_a_live_lane_is_caught_and_nothing_runs(tiny):
    """Someone on the path replays a call frame of the leader's: the worker refuses it before decoding
    (its sequence number is spent), exits with the reason, and the leader's lane fails with it."""
    model, tok, _ = tiny
    pair = Pair(model, tok, tap=True)
    pair.start_worker()
    proxy = pair.engine()
    proxy.init_decode_state()
    deadline = time.monotonic() + 30
    while pair.worker.calls < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    calls = pair.worker.calls
    call = [f for f in pair.tap.frames if f[5] == ch.CALL][-1]
    pair.tap.inject.append(call)  # goes out ahead of the leader's next frame (a ping within a second)
    assert pair.lane.wait_failed(10), "the lane did not notice"
    assert pair.exits and pair.exits[0][0] == 3 and "(replayed?)" in pair.exits[0][1], pair.exits
    assert pair.worker.calls == calls  # the replayed call never ran
    assert "worker 1 (test-worker) closed the step lane" in pair.lane.failure
    pair.lane.close()
