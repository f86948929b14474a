"""The step lane's wire, in one process: its value format (every type round-trips, nothing malformed or
pickled decodes, nothing runs) and its authenticated channel (the handshake proves the secret both ways;
replayed, altered, cut, oversized and foreign-version frames break the connection)."""

from __future__ import annotations

import pickle
import socket
import struct
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from vsurge.contracts.sampling_params import SamplingParams
from vsurge.multihost import channel as ch
from vsurge.multihost import wire
from vsurge.multihost.engine_proxy import register_records

SECRET = b"0123456789abcdef0123456789abcdef-group"


# ------------------------------------------------------------------------------------ the format


def _no_arrays(_):
    raise AssertionError("no device arrays here")


def _roundtrip(value):
    register_records()
    return wire.decode(wire.encode(value, _no_arrays), _no_arrays, _no_arrays)


def test_values_cross_the_lane_as_they_left():
    from vsurge.engines.dense.mixed_step import Chunk

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
