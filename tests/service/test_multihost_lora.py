"""LoRA adapters on a multi-host group: the bank on every process, each adapter's weights sent once down
the step lane by the leader (engines/lora_bank.py stage / load / unload), each row's adapter slot carried
by the lane calls that run it.

Slow: a real group of two `vsurge serve` processes (2 devices each, tp=4 over both) serving `--lora`
adapters, then one loaded at run time, against the single-process engine's tokens. Fast: a leader and a
worker engine of each driver in one process (test_multihost_lane's Pair) over a real lane: the worker's
bank equals the leader's, leaf for leaf, after stage, load, eviction and unload; and the leader's whole
driver (oDriver quick, vDriver slow) serving the parity batch over the lane, the worker's arrays then
equal to the leader's.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import pytest
from lora_adapters import ADAPTERS, adapter_setup, bank_config, run_all
from multihost_group import Group, client
from test_multihost_lane import Pair

# (prompt, adapter): the base and two --lora adapters in one batch, one of them on a prompt longer than
# the largest prefill bucket (32: prefill_chunked carries its adapter), then "legal", loaded at run time
# into a full bank (2 slots: it evicts one), then the evicted adapter again (written back from each
# process's own copy)
LONG = [(7 * i + 3) % 300 + 1 for i in range(40)]
BATCH = [
    ([5, 17, 42, 99, 3, 250, 7], None),
    ([11, 12, 13], "sql"),
    ([200, 201, 202, 203], "chat"),
    (LONG, "sql"),
]
LATER = [([64, 65, 66], "legal"), ([9, 8, 7, 6], "sql"), ([9, 8, 7, 6], "chat")]
TOKENS = 8


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    """(model path, base torch model, {name: (adapter dir, merged torch model)}): the tiny Llama of the
    LoRA tests (8 heads, 4 kv heads: tp=4 splits them)."""
    return adapter_setup(tiny_checkpoint, tmp_path_factory)


def _single_process(setup, cases) -> list[list[int]]:
    """Greedy tokens of one process's vdriver (one device) serving every adapter of ADAPTERS."""
    import vsurge
    from vsurge import vSurge

    path, _, adapters = setup
    model, tok = vsurge.load_model(path)
    config = vsurge.EngineConfig(
        enable_lora=True, max_loras=3, max_lora_rank=16, max_concurrent_decodes=4, max_length=64
    )
    surge = vSurge.create(model, tok, config)
    surge.compile()
    surge.start()
    try:
        for name in ADAPTERS:
            surge.lora.add(name, adapters[name][0])
        prompts, names = [p for p, _ in cases], [n for _, n in cases]
        return [ids for ids, _ in asyncio.run(run_all(surge, prompts, names, TOKENS, logprobs=False))]
    finally:
        surge.stop()
        jax.clear_caches()


def _greedy(group: Group, prompt: list[int], adapter: str | None) -> list[int]:
    r = client(group).completions.create(
        model=adapter or "tiny",
        prompt=prompt,
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(r.choices[0].model_extra["token_ids"])


def _batch(group: Group, cases) -> list[list[int]]:
    """Every case at once (they share the decode batch)."""
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(lambda c: _greedy(group, *c), cases))


@pytest.mark.timeout(900)
def test_adapters_on_a_group_make_the_single_process_tokens(tmp_path, setup):
    """A group of 2 processes x 2 devices (tp=4 spans both, so each process holds half of every split
    adapter weight) serving two --lora adapters: the base and both adapters in one batch (one on a chunked
    prompt) make the single-process engine's greedy tokens; an adapter loaded at run time into the full
    bank evicts one, the evicted one comes back from each process's copy, both with the single-process
    tokens; an unloaded adapter is then unknown (404) and the base still serves."""
    path, _, adapters = setup
    knobs = {
        "VSURGE_MAX_CONCURRENT_DECODES": "4",
        "VSURGE_MAX_LORAS": "2",
        "VSURGE_MAX_LORA_RANK": "16",
        "VSURGE_ENABLE_LORA_RUNTIME_UPDATES": "1",
    }
    loras = ["--lora", f"sql={adapters['sql'][0]}", "--lora", f"chat={adapters['chat'][0]}"]
    t0 = time.monotonic()
    group = Group(tmp_path, path, 2, 2, "tp=4", "vdriver", env={0: knobs, 1: knobs}, args=loras)
    try:
        want = _single_process(setup, BATCH + LATER)  # while the group starts
        group.wait_ready()
        started = time.monotonic() - t0
        assert _batch(group, BATCH) == want[: len(BATCH)], group.logs_text()

        r = httpx.post(
            f"{group.url}/v1/load_lora_adapter",
            json={"lora_name": "legal", "lora_path": adapters["legal"][0]},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        got = [_greedy(group, *case) for case in LATER]  # one at a time: each evicts the other's slot
        assert got == want[len(BATCH) :], group.logs_text()

        r = httpx.post(f"{group.url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
        assert r.status_code == 200, r.text
        with pytest.raises(Exception, match="404"):
            _greedy(group, [1, 2, 3], "chat")
        assert _greedy(group, *BATCH[0]) == want[0]
        models = {m.id for m in client(group).models.list().data}
        assert models == {"tiny", "sql", "legal"}, models
        assert all(p.poll() is None for p in group.procs), group.logs_text()
        print(f"\ngroup ready in {started:.1f}s; whole test {time.monotonic() - t0:.1f}s")
    finally:
        group.close()


# ------------------------------------------------------------------------------------ one process


@pytest.fixture(scope="module")
def tiny_lora(setup):
    import vsurge

    path, _, adapters = setup
    model, tok = vsurge.load_model(path)
    return model, tok, adapters


def _bank_leaves(engine) -> list[np.ndarray]:
    """Every bank array of every weight tree the engine hands its programs, as host arrays."""
    from vsurge.engines.lora_bank import _leaf
    from vsurge.models.lora import TARGETS

    return [
        np.asarray(_leaf(tree, layer, module, name)[...])
        for tree in engine.lora_trees()
        for layer in range(engine.model_config.num_layers)
        for module in TARGETS
        for name in ("lora_a", "lora_b")
    ]


@pytest.mark.parametrize("driver", ["vdriver", "odriver"])
def test_the_workers_bank_is_the_leaders_after_every_write(tiny_lora, driver):
    """LoraAdapters over a LeaderEngine, as a driver builds them on the leader: adding two adapters
    stages them on the worker (the lane carries the weights), pinning writes slots, a third adapter evicts
    one, unloading empties its slot; after each, the worker engine's bank (its own arrays) equals the
    leader's, leaf for leaf, and the adapters' slots are not empty."""
    from vsurge.drivers.lora_adapters import LoraAdapters

    model, tok, adapters = tiny_lora
    pair = Pair(model, tok)
    pair.start_worker()
    knobs = {"page_size": 16} if driver == "odriver" else {}
    proxy = pair.engine(driver=driver, enable_lora=True, max_loras=2, max_lora_rank=16, **knobs)
    leader = proxy.engine
    lora = LoraAdapters([proxy])

    def caught_up() -> None:
        deadline = time.monotonic() + 60
        while pair.worker.calls < pair.lane.calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pair.exits, pair.exits

    def worker_bank_equal() -> None:
        caught_up()
        ours, theirs = _bank_leaves(leader), _bank_leaves(pair.worker.engine)
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs, strict=True):
            assert np.array_equal(a, b)

    class Req:
        def __init__(self, rid, adapter):
            self.id, self.adapter = rid, adapter

    for name in ("sql", "chat"):
        lora.add(name, adapters[name][0])
    caught_up()
    assert sorted(pair.worker.engine.lora_bank.staged) == ["chat#2", "sql#1"]
    reqs = [Req(str(i), n) for i, n in enumerate(("sql", "chat"))]
    for r in reqs:
        lora.enter(r)
        lora.pin(r, wait=False)
    worker_bank_equal()
    assert sum(np.abs(x).max() > 0 for x in _bank_leaves(leader)) >= 14  # sql's 4 and chat's 3 modules x 2
    lora.leave(reqs[0])  # sql's slot is free to take
    lora.add("legal", adapters["legal"][0])
    third = Req("2", "legal")
    lora.enter(third)
    assert lora.pin(third, wait=False) == lora.resident()["legal"]
    assert "sql" not in lora.resident()  # evicted: legal was written over it on both
    worker_bank_equal()
    lora.remove("chat")
    lora.leave(reqs[1])  # chat's last request ends: its slot is emptied and its weights forgotten
    worker_bank_equal()
    assert sorted(pair.worker.engine.lora_bank.staged) == ["legal#3", "sql#1"]
    assert sorted(leader.lora_bank.staged) == ["legal#3", "sql#1"]
    pair.lane.close()


@pytest.mark.parametrize("driver", ["odriver", "vdriver"])
def test_a_driver_over_the_lane_serves_adapters_and_the_worker_keeps_up(setup, tiny_lora, driver):
    """The leader's whole driver over a LeaderEngine (leader_surge, as `vsurge serve` builds it on a
    group) serving three adapters and the base in one batch (lora_adapters' parity batch): transformers'
    merged tokens, and afterwards every array the leader still holds (the KV cache its requests wrote,
    each row under its adapter) equals the worker's replay of it, so every adapter slot crossed."""
    from lora_adapters import NAMES, PROMPTS, reference

    from vsurge.multihost.lockstep_surge import leader_surge

    model, tok, adapters = tiny_lora
    pair = Pair(model, tok)
    pair.start_worker()
    pair.lane.wait_workers("loaded", 60, "load")
    knobs = {"page_size": 8} if driver == "odriver" else {}
    config = bank_config(driver, **knobs)
    surge = leader_surge(model, tok, config, pair.lane)
    try:
        surge.compile()
        surge.start()
        for name in ADAPTERS:
            surge.lora.add(name, adapters[name][0])
        got = asyncio.run(run_all(surge, PROMPTS, NAMES, logprobs=False))
        assert [ids for ids, _ in got] == [ids for ids, _ in reference(setup)]
        assert surge.lora.wait_idle(10)
        deadline = time.monotonic() + 60
        while pair.worker.calls < pair.lane.calls and time.monotonic() < deadline:
            time.sleep(0.05)
        with pair.lane.call_lock:  # no call in flight: the leader's live arrays and the worker's match
            assert pair.worker.calls == pair.lane.calls and not pair.exits, pair.exits
            live = [(cell[0], ref()) for cell, ref in list(pair.lane.handles._known.values())]
            live = [(h, x) for h, x in live if x is not None and not x.is_deleted()]
            assert sum(x.size for _, x in live) > 10_000, "the KV cache is among them"
            for handle, x in live:
                assert np.array_equal(np.asarray(pair.worker.handles[tuple(handle)]), np.asarray(x)), handle
    finally:
        surge.stop()
        jax.clear_caches()
