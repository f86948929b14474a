"""A leader and a worker engine in one process joined by a real step lane on loopback (one device each, no
collectives): the worker replays every call and holds the leader's arrays, a silent worker, a slow or
never-loading leader, a failure only the worker sees, a frame replayed into the live lane, and what the
leader's engine refuses to reach behind the lane. Fast: no JAX group, no compile beyond one tiny engine."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest
from multihost_group import TEST_LANE_TIMEOUT_S, free_port
from patience import ceiling

from vsurge.contracts.request import EngineUnavailableError
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.multihost import channel as ch
from vsurge.multihost.engine_proxy import LaneRefused, LeaderEngine, build_engine, engine_setup
from vsurge.multihost.group import ProcessGroup
from vsurge.multihost.lane_leader import SILENCE, LeaderLane
from vsurge.multihost.lane_worker import WorkerLane

SECRET = b"0123456789abcdef0123456789abcdef-group"
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 61, 88, 12, 250, 9]]
MAX_TOKENS = 8


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
    ``tap`` the worker reaches its leader through a Tap.

    The bound is the suite's generous one (TEST_LANE_TIMEOUT_S, 30 s): both engines compile in this one
    process, and on a loaded machine the worker's beats came 3.4 s late while it compiled, which at the
    default 10 s (5 s of silence) once failed a replay test that was right. The default bound is tested at
    10 s by test_multihost.py's group."""

    def __init__(self, model, tok, timeout: float = TEST_LANE_TIMEOUT_S, tap: bool = False):
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

    def wait_exit(self, timeout: float = 30) -> tuple[int, str | None]:
        """The worker's exit (code, reason), once it has taken it (after it told the leader why)."""
        deadline = time.monotonic() + timeout
        while not self.exits and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.exits, "the worker did not exit"
        return self.exits[0]

    def start_worker(self) -> None:
        def work():
            self.worker.connect(30)
            self.worker.loaded(None)
            self.done["rc"] = self.worker.run(self.model, self.tok)

        threading.Thread(target=work, daemon=True).start()

    def engine(self, **knobs):
        from vsurge.contracts.engine_config import EngineConfig

        self.lane.wait_workers("loaded", 60, "load")
        config = EngineConfig(max_concurrent_decodes=2, max_length=64, prefill_lengths=(32,), **knobs)
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
    assert pair.lane.wait_failed(ceiling(pair.lane.timeout)), "the lane did not notice a silent worker"
    took = time.monotonic() - t0
    assert took <= pair.lane.timeout, took
    assert "worker 1 (test-worker) sent nothing" in pair.lane.failure
    with pytest.raises(EngineUnavailableError, match="worker 1"):
        proxy.decode(state)
    pair.lane.close()


def _same_on_the_worker(pair, result) -> None:
    """Every device array of the leader's last call's ``result`` equals the worker's (its handles)."""
    import jax

    n = pair.lane.calls - 1
    deadline = time.monotonic() + 60
    while pair.worker.calls <= n and time.monotonic() < deadline:
        time.sleep(0.05)
    leaves = [x for x in jax.tree_util.tree_leaves(result) if isinstance(x, jax.Array)]
    assert leaves
    for i, x in enumerate(jax.tree_util.tree_leaves(result)):
        if isinstance(x, jax.Array):
            assert np.array_equal(np.asarray(pair.worker.handles[(n, i)]), np.asarray(x)), (n, i)


def test_mixed_steps_verify_steps_and_masked_steps_replay_exactly(tiny):
    """vDriver's in-place prefill (mixed.step, mixed.seat), an n-gram verify step and a structured step
    (decode_logits, then decode_sample under a token mask), each called through the lane as the driver
    calls them: the worker's state after each is the leader's, leaf for leaf."""
    from vsurge.engines.dense.mixed_step import Chunk

    model, tok, _ = tiny
    pair = Pair(model, tok)
    pair.start_worker()
    proxy = pair.engine(max_num_batched_tokens=32, speculative="ngram", num_speculative_tokens=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = PROMPTS[1] * 4  # 36 tokens: two mixed steps of at most 24 prompt tokens
    state, done = proxy.init_decode_state(), 0
    while done < len(prompt):
        shape, (take,) = proxy.mixed.step_plan([len(prompt) - done])  # host-only: the leader alone
        chunk = Chunk(0, done, np.asarray(prompt[done : done + take], np.int32))
        state, out, hidden = proxy.mixed.step(state, [chunk], shape)
        done += take
    row = proxy.make_sampling_row(greedy, [])  # host arrays, sent by value
    state, first = proxy.mixed.seat(state, hidden, 0, 0, len(prompt), row, np.array([7, 9], np.uint32))
    _same_on_the_worker(pair, (state, first))

    draft = np.zeros((2, 3), np.int32)
    draft[0] = [92, 92, 92]
    state, verified = proxy.verify(state, draft, np.array([3, 0], np.int32))
    _same_on_the_worker(pair, (state, verified))

    state, logits = proxy.decode_logits(state)
    words = -(-model.config.vocab_size // 32)
    mask = np.zeros((2, words), np.int32)
    mask[:, 0] = 0b1010  # only ids 1 and 3 allowed
    state, out = proxy.decode_sample(state, logits, mask)
    _same_on_the_worker(pair, (state, out))
    assert int(np.asarray(out.tokens)[0]) in (1, 3)
    assert not pair.exits
    pair.lane.close()


def test_paged_masked_steps_replay_exactly(tiny):
    """oDriver's structured step through the lane as the driver calls it: step_logits, then step_sample
    with a constrained final chunk's first-token mask, then a decode step under the rows' mask; the
    worker's state after each is the leader's, and the tokens keep to their masks."""
    from vsurge.engines.paged.mixed_step import ChunkWork

    model, tok, _ = tiny
    pair = Pair(model, tok)
    pair.start_worker()
    proxy = pair.engine(driver="odriver", page_size=16, max_num_batched_tokens=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = PROMPTS[1]
    inputs = proxy.seq_inputs(greedy, [], np.array([7, 9], np.uint32), prompt)
    width = proxy.table_width
    row = np.zeros(width, np.int32)
    row[0] = 1  # the prompt's page (page 0 is scratch)
    table = np.zeros((2, width), np.int32)
    table[0] = row
    words = -(-model.config.vocab_size // 32)
    first_mask = np.zeros((1, words), np.int32)
    first_mask[0, 0] = 0b10100  # only ids 2 and 4
    chunk = ChunkWork(np.asarray(prompt, np.int32), 0, row, 0, inputs, token_mask=first_mask)
    state = proxy.init_decode_state()
    none = np.zeros(0, bool)
    state, logits = proxy.step_logits(state, table, none, [chunk])
    state, out, firsts = proxy.step_sample(state, logits, none, [chunk])
    _same_on_the_worker(pair, (state, firsts))
    assert out is None and int(np.asarray(firsts[0][1].tokens)[0]) in (2, 4)

    active = np.array([True])
    state, logits = proxy.step_logits(state, table, active)
    mask = np.full((2, words), -1, np.int32)
    mask[0] = 0
    mask[0, 0] = 0b1010  # only ids 1 and 3
    state, out, _ = proxy.step_sample(state, logits, active, [], mask)
    _same_on_the_worker(pair, (state, out))
    assert int(np.asarray(out.tokens)[0]) in (1, 3)
    assert not pair.exits
    pair.lane.close()


def test_decode_blocks_cross_the_lane_and_replay_exactly(tiny):
    """decode_block (K decode steps in one program) is a lane method: the worker's state after a block is
    the leader's, and its tokens are the single steps' (the reference)."""
    model, tok, reference = tiny
    pair = Pair(model, tok)
    pair.start_worker()
    proxy = pair.engine(decode_steps=MAX_TOKENS - 1)
    assert proxy.decode_steps == MAX_TOKENS - 1  # a plain setting, read on the leader
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    state = proxy.init_decode_state()
    rows = [[] for _ in PROMPTS]
    for slot, prompt in enumerate(PROMPTS):
        state, first = proxy.insert(proxy.prefill(prompt, greedy), state, slot, length=len(prompt))
        rows[slot].append(int(np.asarray(first.tokens)[0]))
    state, block = proxy.decode_block(state)
    _same_on_the_worker(pair, (state, block))
    for slot in range(len(PROMPTS)):
        rows[slot] += [int(t) for t in np.asarray(block.tokens)[slot]]
    assert rows == reference and not pair.exits
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
    pair = Pair(model, tok, timeout=8.0)
    pair.start_worker()
    pair.lane.wait_workers("loaded", 60, "load")
    time.sleep(3 * SILENCE * 8.0)  # the leader "compiles"
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
    code, why = pair.wait_exit()
    assert code == 1 and "no engine setup within 2s" in why
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
    code, why = pair.wait_exit()
    assert code == 1 and "never made" in why
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
    assert pair.lane.wait_failed(60), "the lane did not notice"
    code, why = pair.wait_exit()
    assert code == 3 and "(replayed?)" in why, why
    assert pair.worker.calls == calls  # the replayed call never ran
    assert "worker 1 (test-worker) closed the step lane" in pair.lane.failure
    pair.lane.close()


def test_a_failed_group_answers_503_engine_unavailable(tiny):
    """What docs/architecture.md promises once a group fails: a real server over the leader's vSurge (the
    worker replaying every call) answers, then its worker goes silent; the lane fails, readiness answers
    503, and a new request gets 503 with Retry-After and error code ``engine_unavailable``, naming why."""
    import httpx

    from vsurge.contracts.engine_config import EngineConfig
    from vsurge.multihost.lockstep_surge import leader_surge
    from vsurge.server import start, vSurgeApiServer

    model, tok, _ = tiny
    pair = Pair(model, tok)
    pair.start_worker()
    pair.lane.wait_workers("loaded", 60, "load")
    config = EngineConfig(max_concurrent_decodes=2, max_length=64, prefill_lengths=(32,))
    surge = leader_surge(model, tok, config, pair.lane, name="tiny")
    api = vSurgeApiServer({"tiny": surge})
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=True, progress=None)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    try:
        running.wait_ready(600)
        assert httpx.post(f"{running.url}/v1/completions", json=body, timeout=120).status_code == 200

        pair.worker._ended.set()  # its beats and its reader stop, as under SIGSTOP
        assert pair.lane.wait_failed(ceiling(pair.lane.timeout)), "the lane did not notice a silent worker"
        assert httpx.get(f"{running.url}/readiness", timeout=30).status_code == 503
        r = httpx.post(f"{running.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "server_error", error
        assert "worker 1 (test-worker) sent nothing" in error["message"], error
    finally:
        running.stop()
        pair.lane.close()
