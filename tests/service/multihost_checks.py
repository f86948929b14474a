"""What the multi-host serving tests send and measure: one list of requests covering every engine feature
(greedy, seeded samples with n > 1, a prompt longer than a prefill bucket, a repetitive prompt for n-gram
drafts, structured output), forged peers against the step lane, and the timing of a fault."""

from __future__ import annotations

import pickle
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from multihost_group import Group, client

from vsurge.multihost import channel as ch

LONG = [(7 * i + 3) % 300 for i in range(40)]  # > the 32-token prefill bucket: chunked
# the tiny model's greedy text falls into "92 92 92 ...": n-gram drafts (prompt lookup) find it and are right
REPEAT = [200, 3, 3, 150, 61, 88, 12, 250, 9, 40, 77, 105, 184, 279, 92, 92, 92]
REGEX = r"[0-9]{3}-[a-z]{2,5}"


def run_requests(group: Group, structured: bool = True) -> dict[str, object]:
    """Every request of the feature matrix, one after another (each alone in its steps, so the same
    programs run in one process and in a group); returns what each produced. ``structured``: send the
    regex request too (both drivers have structured output)."""
    c = client(group)
    out: dict[str, object] = {}

    def tokens(r):
        return [list(ch_.model_extra["token_ids"]) for ch_ in r.choices]

    for name, prompt in (("greedy", [5, 17, 42, 99, 7]), ("long", LONG), ("repeat", REPEAT)):
        r = c.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        out[name] = tokens(r)
    r = c.completions.create(
        model="tiny",
        prompt=[200, 3, 3, 150, 61, 88, 12, 250, 9],
        max_tokens=10,
        temperature=1.0,
        seed=7,
        n=2,
        extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 40},
    )
    out["seeded_n2"] = tokens(r)
    if not structured:
        return out
    r = c.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=16,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"regex": REGEX}, "return_token_ids": True},
    )
    assert re.fullmatch(REGEX, r.choices[0].text), r.choices[0].text
    out["structured"] = [r.choices[0].text, *tokens(r)]
    return out


def speculation(group: Group) -> str:
    """What the leader's /metrics say of n-gram speculation so far (whether verify steps crossed the lane
    depends on the step costs the leader measured: reported, not asserted)."""
    text = httpx.get(f"{group.url}/metrics", timeout=30).text
    found = dict(
        re.findall(r"^vsurge_spec_decode_(draft|accepted)_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    )
    return f"speculation: {float(found.get('draft', 0)):.0f} draft tokens verified, {float(found.get('accepted', 0)):.0f} accepted"


def concurrent_burst(group: Group, n: int = 4) -> None:
    """Requests at once (the leader's driver threads interleave their engine calls): all complete."""
    c = client(group)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            r = c.completions.create(
                model="tiny", prompt=[i + 1, 2, 3], max_tokens=8, temperature=0.5, seed=i
            )
            assert r.choices[0].finish_reason in ("length", "stop")
        except BaseException as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors


# ------------------------------------------------------------------------------------ forged peers


def _frame(kind: int, payload: bytes, seq: int = 0) -> bytes:
    return b"VSLN" + struct.pack("!BBHQI", 1, kind, 0, seq, len(payload)) + payload + bytes(ch.MAC_SIZE)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    """True when the leader hung up on us (what a refused peer gets)."""
    try:
        while s.recv(4096):
            pass
        return True
    except (ConnectionError, TimeoutError, OSError):
        return True


def forged_peers(group: Group, tmp: Path) -> list[str]:
    """Attack the leader's lane as a peer without the secret (and with a stolen exchange); returns what
    was tried. The payload that would write a file never may."""
    port, tried = group.lane_port, []
    target = tmp / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (target, "the lane ran a pickle"))

    bomb = pickle.dumps(Payload())
    # the old lane's own first frame: a length-prefixed pickle
    s = _connect(port)
    s.sendall(struct.pack("!Q", len(bomb)) + bomb)
    assert _closed_by_peer(s)
    tried.append("an unauthenticated pickle as the first frame")
    # the same pickle inside a well-formed frame header
    s = _connect(port)
    s.recv(4096)  # HELLO
    s.sendall(_frame(ch.AUTH, bomb[:200]))
    assert _closed_by_peer(s)
    tried.append("a pickle as the auth payload")
    # no secret: any proof at all
    s = _connect(port)
    s.recv(4096)
    s.sendall(_frame(ch.AUTH, struct.pack("!I", 1) + bytes(64)))
    assert _closed_by_peer(s)
    tried.append("no secret (a zero proof)")
    # a wrong secret, through the real handshake code
    s = _connect(port)
    try:
        ch.worker_handshake(s, b"not-the-group-secret-but-long-enough-!", 1, len(group.procs), "leader")
        raise AssertionError("the leader accepted a wrong secret")
    except ch.AuthError:
        pass
    tried.append("a wrong secret")
    # the right secret, recorded, replayed on a new connection (a fresh challenge): refused
    secret = ch.read_secret({ch.SECRET_ENV: str(group.secret)})
    s = _connect(port)
    hello = s.recv(4096)
    nonce = hello[20 : 20 + ch.NONCE_SIZE]
    import hashlib
    import hmac

    ids = struct.pack("!II", 1, len(group.procs))
    wn = bytes(32)
    proof = hmac.new(secret, b"vsurge-lane/1 worker" + nonce + wn + ids, hashlib.sha256).digest()
    auth = _frame(ch.AUTH, struct.pack("!I", 1) + wn + proof)
    s.sendall(auth)  # right proof, but process 1 is connected already: refused
    assert _closed_by_peer(s)
    s = _connect(port)
    s.recv(4096)
    s.sendall(auth)  # the recorded exchange, replayed
    assert _closed_by_peer(s)
    tried.append("a recorded handshake replayed")
    # a frame replayed back at the leader (its own hello)
    s = _connect(port)
    s.sendall(s.recv(4096))
    assert _closed_by_peer(s)
    tried.append("the leader's own frame replayed to it")
    # a truncated frame: a header promising more than comes, then silence
    s = _connect(port)
    s.recv(4096)
    s.sendall(_frame(ch.AUTH, bytes(68))[:30])
    assert _closed_by_peer(s)
    tried.append("a truncated frame")
    # a header claiming a huge payload: refused before anything is read
    s = _connect(port)
    s.recv(4096)
    s.sendall(b"VSLN" + struct.pack("!BBHQI", 1, ch.AUTH, 0, 0, 2**31))
    assert _closed_by_peer(s)
    tried.append("a frame claiming 2 GiB")
    assert not target.exists(), "the lane ran a forged payload"
    return tried


# ------------------------------------------------------------------------------------ faults


@dataclass
class FaultTimes:
    """Seconds from the fault to each thing the bound promises (None: did not happen)."""

    fault: str
    stream_error: float | None = None  # the in-flight stream ended (503 / error event / reset)
    unready: float | None = None  # /readiness answered 503 (or the leader was gone)
    new_503: float | None = None  # a new request was refused with 503 + Retry-After
    new_503_code: str | None = None  # that answer's error code
    exits: dict[int, tuple[int | None, float]] = field(default_factory=dict)  # process -> (code, seconds)

    def line(self, bound: float) -> str:
        f = lambda x: "-" if x is None else f"{x:.2f}s"  # noqa: E731
        ex = ", ".join(f"p{i} exit {c} at {t:.2f}s" for i, (c, t) in sorted(self.exits.items()))
        return (
            f"{self.fault}: stream ended {f(self.stream_error)}, unready {f(self.unready)}, "
            f"new request 503 {f(self.new_503)}, {ex} (bound {bound:.0f}s)"
        )


def inject_fault(group: Group, fault: str, victim: int, kill) -> FaultTimes:
    """Start a long stream; when its first token arrives, ``kill(proc)`` process ``victim``; measure."""
    import openai

    times = FaultTimes(fault)
    c = client(group, timeout=120)
    stream = c.completions.create(
        model="tiny",
        prompt=[5, 17, 42],
        max_tokens=55,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it)
    t0 = time.monotonic()
    kill(group.procs[victim])
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set() and (times.unready is None or times.new_503 is None):
            now = time.monotonic() - t0
            try:
                if (
                    times.unready is None
                    and httpx.get(f"{group.url}/readiness", timeout=2).status_code == 503
                ):
                    times.unready = now
                if times.new_503 is None:
                    r = httpx.post(
                        f"{group.url}/v1/completions",
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                        timeout=2,
                    )
                    if r.status_code == 503 and r.headers.get("Retry-After"):
                        times.new_503 = time.monotonic() - t0
                        times.new_503_code = r.json().get("error", {}).get("code")
            except httpx.HTTPError:
                if group.procs[0].poll() is not None:  # the leader is gone: nothing answers
                    times.unready = times.unready if times.unready is not None else now
                    return
            time.sleep(0.1)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        for _ in it:
            pass
    except (openai.APIError, httpx.HTTPError):
        times.stream_error = time.monotonic() - t0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(times.exits) < len(group.procs) - (fault == "SIGSTOP worker"):
        for i, p in enumerate(group.procs):
            if i not in times.exits and p.poll() is not None:
                times.exits[i] = (p.returncode, time.monotonic() - t0)
        time.sleep(0.05)
    stop.set()
    prober.join(5)
    return times
