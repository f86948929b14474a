"""One authenticated connection of the step lane: a challenge-response on connect, then MAC'd frames.

Every frame is a fixed header, a payload and a MAC::

    magic "VSLN" | version u8 | kind u8 | reserved u16 | sequence u64 | payload length u32 | payload | mac[32]

Connect (``leader_handshake`` / ``worker_handshake``), both sides holding the group's secret::

    leader -> worker   HELLO    leader nonce (32 random bytes), group size
    worker -> leader   AUTH     process id, worker nonce, HMAC(secret, "worker" | nonces | id | size)
    leader -> worker   WELCOME  HMAC(secret, "leader" | nonces | id | size)

so each side proves it knows the secret without sending it, and an AUTH recorded on one connection is
worthless on the next (a fresh leader nonce). Both then derive one key per direction from the secret and
the nonces; every later frame carries ``HMAC(key, header | payload)`` and its sequence number, which must
be exactly the next one: a replayed, reordered, injected, altered or truncated frame fails its check and
the connection is broken (``ChannelError``), before a byte of its payload is decoded. Sizes are bounded
before anything is read (``MAX_FRAME``; handshake frames ``MAX_HANDSHAKE``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
from collections.abc import Mapping
from pathlib import Path

from . import wire

MAGIC = b"VSLN"
VERSION = wire.VERSION  # a peer of another version is refused at its first frame
_HEADER = struct.Struct("!4sBBHQI")
MAC_SIZE = 32
NONCE_SIZE = 32
MIN_SECRET_BYTES = 32
MAX_FRAME = 1 << 30  # one call's host inputs: prompts, page tables, masks
MAX_HANDSHAKE = 256
SECRET_ENV = "VSURGE_LANE_SECRET_FILE"
_LABEL = b"vsurge-lane/1 "

# frame kinds
HELLO, AUTH, WELCOME = 1, 2, 3
CALL, SETATTR, ENGINE, PING, STOP, ABORT = 10, 11, 12, 13, 14, 15  # leader -> worker
BEAT, ERROR, CALL_FAILED, BYE = 20, 21, 22, 23  # worker -> leader
KINDS = {
    HELLO: "hello",
    AUTH: "auth",
    WELCOME: "welcome",
    CALL: "call",
    SETATTR: "setattr",
    ENGINE: "engine",
    PING: "ping",
    STOP: "stop",
    ABORT: "abort",
    BEAT: "beat",
    ERROR: "error",
    CALL_FAILED: "call-failed",
    BYE: "bye",
}


class ChannelError(ConnectionError):
    """The connection is unusable: closed, timed out, or a frame failed its checks (protocol error)."""


class PeerClosed(ChannelError):
    """The peer closed or reset the connection (its process ended, or it hung up)."""


class AuthError(ChannelError):
    """The peer did not prove it holds the group's secret (or is not a process of this group)."""


class SecretError(ValueError):
    """The lane secret is missing or unusable; the message says what to do."""


def read_secret(env: Mapping[str, str] | None = None) -> bytes:
    """The group's secret from the file ``VSURGE_LANE_SECRET_FILE`` names (surrounding whitespace
    stripped); SecretError when it is unset, unreadable or shorter than MIN_SECRET_BYTES."""
    env = os.environ if env is None else env
    path = env.get(SECRET_ENV, "").strip()
    if not path:
        raise SecretError(
            f"a multi-host group needs a step-lane secret: set {SECRET_ENV} to a file holding at least "
            f"{MIN_SECRET_BYTES} random bytes, the same file for every process of the group (the operator "
            "mounts one per InferenceModel; by hand: `head -c 48 /dev/urandom | base64 > lane.key`)"
        )
    try:
        data = Path(path).read_bytes().strip()
    except OSError as e:
        raise SecretError(f"{SECRET_ENV}={path}: cannot read the step-lane secret ({e.strerror})") from None
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(
            f"{SECRET_ENV}={path}: the step-lane secret has {len(data)} bytes; it needs at least "
            f"{MIN_SECRET_BYTES} random bytes"
        )
    return data


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _ids(pid: int, size: int) -> bytes:
    return struct.pack("!II", pid, size)


class Channel:
    """A connected, authenticated socket: ``send(kind, payload)`` / ``recv() -> (kind, payload)``.

    Sends are serialized by a lock (several threads send on the leader's side); one thread receives."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, peer: str):
        self.sock = sock
        self.peer = peer
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = 0
        self._recv_seq = 0
        self._lock = threading.Lock()

    def send(self, kind: int, payload: bytes = b"") -> None:
        if len(payload) > MAX_FRAME:
            raise ChannelError(f"a frame of {len(payload)} bytes exceeds the lane's {MAX_FRAME}")
        with self._lock:
            header = _HEADER.pack(MAGIC, VERSION, kind, 0, self._send_seq, len(payload))
            mac = _mac(self._send_key, header, payload)
            self._send_seq += 1
            try:
                self.sock.sendall(header + payload + mac)
            except OSError as e:
                raise ChannelError(f"sending to {self.peer} failed ({e})") from None

    def recv(self) -> tuple[int, bytes]:
        kind, seq, payload, mac = _read_frame(self.sock, MAX_FRAME)
        header = _HEADER.pack(MAGIC, VERSION, kind, 0, seq, len(payload))
        if not hmac.compare_digest(mac, _mac(self._recv_key, header, payload)):
            raise ChannelError(f"a frame from {self.peer} failed its MAC (forged or altered)")
        if seq != self._recv_seq:
            raise ChannelError(
                f"a frame from {self.peer} has sequence {seq}, expected {self._recv_seq} (replayed?)"
            )
        self._recv_seq += 1
        return kind, payload

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise
        except OSError as e:
            raise PeerClosed(f"connection lost ({e})") from None
        if not chunk:
            raise PeerClosed("connection closed" if not buf else "connection closed inside a frame")
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket, limit: int) -> tuple[int, int, bytes, bytes]:
    """(kind, sequence, payload, mac) of the next frame; its header is checked before the payload is read."""
    magic, version, kind, reserved, seq, n = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if magic != MAGIC:
        raise ChannelError(f"not a step-lane frame (starts {magic!r})")
    if version != VERSION:
        raise ChannelError(f"step-lane protocol version {version}, this process speaks {VERSION}")
    if kind not in KINDS or reserved:
        raise ChannelError(f"unknown frame kind {kind}")
    if n > limit:
        raise ChannelError(f"a frame of {n} bytes exceeds the limit of {limit}")
    payload = _recv_exact(sock, n)
    return kind, seq, payload, _recv_exact(sock, MAC_SIZE)


def _send_plain(sock: socket.socket, kind: int, payload: bytes) -> None:
    # handshake frames: their proof is in the payload; the MAC field is zeros
    sock.sendall(_HEADER.pack(MAGIC, VERSION, kind, 0, 0, len(payload)) + payload + bytes(MAC_SIZE))


def _recv_plain(sock: socket.socket, want: int) -> bytes:
    kind, _, payload, _ = _read_frame(sock, MAX_HANDSHAKE)
    if kind != want:
        raise AuthError(f"expected frame '{KINDS[want]}', got '{KINDS[kind]}'")
    return payload


def _keys(secret: bytes, ln: bytes, wn: bytes, ids: bytes) -> tuple[bytes, bytes]:
    """(leader -> worker key, worker -> leader key) of one connection."""
    return (
        _mac(secret, _LABEL, b"key leader->worker", ln, wn, ids),
        _mac(secret, _LABEL, b"key worker->leader", ln, wn, ids),
    )


def leader_handshake(
    sock: socket.socket, secret: bytes, group_size: int, allowed: set[int], peer: str
) -> tuple[int, Channel]:
    """The leader's side of a new connection: (the worker's process id, its channel). AuthError when the
    peer does not prove the secret or is not one of ``allowed`` (ids not connected yet)."""
    ln = secrets.token_bytes(NONCE_SIZE)
    _send_plain(sock, HELLO, ln + struct.pack("!I", group_size))
    payload = _recv_plain(sock, AUTH)
    if len(payload) != 4 + NONCE_SIZE + MAC_SIZE:
        raise AuthError(f"an auth frame of {len(payload)} bytes")
    (pid,) = struct.unpack("!I", payload[:4])
    wn, proof = payload[4 : 4 + NONCE_SIZE], payload[4 + NONCE_SIZE :]
    ids = _ids(pid, group_size)
    if not hmac.compare_digest(proof, _mac(secret, _LABEL, b"worker", ln, wn, ids)):
        raise AuthError("wrong proof of the group's secret")
    if pid not in allowed:
        raise AuthError(f"process id {pid} is not a worker of this group waiting to connect")
    _send_plain(sock, WELCOME, _mac(secret, _LABEL, b"leader", ln, wn, ids))
    to_worker, to_leader = _keys(secret, ln, wn, ids)
    return pid, Channel(sock, to_worker, to_leader, peer)


def worker_handshake(sock: socket.socket, secret: bytes, pid: int, group_size: int, peer: str) -> Channel:
    """A worker's side of its connection to the leader; AuthError when the leader does not prove the secret."""
    hello = _recv_plain(sock, HELLO)
    if len(hello) != NONCE_SIZE + 4:
        raise AuthError(f"a hello frame of {len(hello)} bytes")
    ln = hello[:NONCE_SIZE]
    (size,) = struct.unpack("!I", hello[NONCE_SIZE:])
    if size != group_size:
        raise AuthError(f"the leader runs a group of {size} processes, this one expects {group_size}")
    wn = secrets.token_bytes(NONCE_SIZE)
    ids = _ids(pid, group_size)
    _send_plain(sock, AUTH, struct.pack("!I", pid) + wn + _mac(secret, _LABEL, b"worker", ln, wn, ids))
    try:
        welcome = _recv_plain(sock, WELCOME)
    except ChannelError as e:
        raise AuthError(f"the leader refused this process ({e}): is the lane secret the group's?") from None
    if not hmac.compare_digest(welcome, _mac(secret, _LABEL, b"leader", ln, wn, ids)):
        raise AuthError("the leader did not prove the group's secret")
    to_worker, to_leader = _keys(secret, ln, wn, ids)
    return Channel(sock, to_leader, to_worker, peer)
