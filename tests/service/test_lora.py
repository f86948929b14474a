"""LoRA adapters against PEFT's merged models in transformers (PyTorch CPU), on both drivers: three
adapters and the base in one batch, loads compile nothing, eviction, unload while in use, no leak."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jit_watch import compilations
from lora_adapters import (
    ADAPTERS,
    NAMES,
    PROMPTS,
    adapter_setup,
    bank_config,
    collect,
    ids_request,
    make_adapter,
    reference,
    run_all,
)

import vsurge
from vsurge import vSurge
from vsurge.drivers.lora_adapters import UnknownAdapterError
from vsurge.models import logits
from vsurge.models.lora import lora_delta
from vsurge.models.peft_adapter import AdapterError, read_adapter

REL = 1e-4  # test_model_parity's bound on max |ours - transformers| / max |transformers|


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    """(model path, base torch model, {name: (adapter dir, merged torch model)})."""
    return adapter_setup(tiny_checkpoint, tmp_path_factory)


def test_lora_delta_gather_and_one_hot_agree():
    """Both forms of the per-row update (few tokens: each gathers its A/B; many: one-hot over the bank)
    against the plain per-row product, slots -1 adding nothing."""
    rng = np.random.RandomState(0)
    a, b = rng.randn(3, 16, 4).astype(np.float32), rng.randn(3, 4, 8).astype(np.float32)
    for t in (2, 3, 7):  # <= 3 slots: gathered; 7: one-hot
        x = rng.randn(t, 16).astype(np.float32)
        ids = rng.randint(-1, 3, t).astype(np.int32)
        want = np.stack([x[i] @ a[s] @ b[s] if s >= 0 else np.zeros(8) for i, s in enumerate(ids)])
        got = np.asarray(lora_delta(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(a), jnp.asarray(b)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_model_logits_match_merged_adapters(setup):
    """The forward with each row on its own adapter (rows 0-2) or none (row 3) equals transformers with
    each adapter merged into the weights (PEFT's merge_and_unload)."""
    path, hf, adapters = setup
    model, tok = vsurge.load_model(path, dtype="float32")
    engine = vsurge.vEngine(
        model, tok, config=vsurge.EngineConfig(enable_lora=True, max_loras=4, max_lora_rank=16)
    )
    from vsurge.engines.lora_bank import LoraBank

    bank = LoraBank([engine])
    for slot, name in enumerate(ADAPTERS):
        bank.write(slot, read_adapter(adapters[name][0], engine.model_config, 16))
    ids = np.random.RandomState(1).randint(0, 320, (4, 24))
    ours = logits(nnx.merge(engine.graphdef, engine.params), ids, adapters=[0, 1, 2, -1])
    worst = 0.0
    for row, name in enumerate(NAMES):
        ref_model = adapters[name][1] if name else hf
        with torch.no_grad():
            ref = ref_model(torch.tensor(ids[row : row + 1])).logits.numpy()[0]
        worst = max(worst, float(np.abs(ours[row] - ref).max() / np.abs(ref).max()))
    assert worst < REL, f"relative error {worst}"
    # the adapters matter: the base's logits differ from an adapter's by far more than the bound
    with torch.no_grad():
        base = hf(torch.tensor(ids[:1])).logits.numpy()[0]
    assert np.abs(ours[0] - base).max() / np.abs(base).max() > 100 * REL


def test_adapters_that_do_not_fit_are_refused(setup, tmp_path, tiny_checkpoint):
    path, _, adapters = setup
    model, _ = vsurge.load_model(path)
    with pytest.raises(AdapterError, match="exceeds --max-lora-rank 8"):
        read_adapter(adapters["legal"][0], model.config, 8)  # rank 16
    other_path, other = tiny_checkpoint("llama", hidden=32, heads=4, kv_heads=2)
    make_adapter(other, tmp_path / "other", "sql", seed=0)
    with pytest.raises(AdapterError, match="do not fit the base model's projection"):
        read_adapter(str(tmp_path / "other"), model.config, 16)
    with pytest.raises(AdapterError, match="not a PEFT adapter directory"):
        read_adapter(str(tmp_path), model.config, 16)


@pytest.fixture(scope="module", params=["vdriver", "odriver"])
def served(request, setup):
    """A started vSurge of either driver serving the three adapters (a bank of 2 slots: three adapters
    and the base in one batch fit only with... 3: every adapter resident at once)."""
    path, _, adapters = setup
    model, tok = vsurge.load_model(path)
    config = bank_config(request.param, **({"page_size": 8} if request.param == "odriver" else {}))
    surge = vSurge.create(model, tok, config)
    surge.compile()
    surge.start()
    for name in ADAPTERS:
        surge.lora.add(name, adapters[name][0])
    yield request.param, surge
    surge.stop()
    jax.clear_caches()


def test_three_adapters_and_the_base_in_one_batch_match_transformers(served, setup):
    """Greedy tokens equal the merged models'; each token's logprob (log_softmax of the logits) is within
    the parity bound of transformers'. Nothing compiles on the way: not the first load of an adapter."""
    driver, surge = served
    want = reference(setup)
    with compilations() as seen:
        got = asyncio.run(run_all(surge, PROMPTS, NAMES))
    assert seen == [], f"{driver} compiled on a live request: {seen}"
    worst = 0.0
    for (ids, lps), (ref_ids, ref_lps), name in zip(got, want, NAMES, strict=True):
        assert ids == ref_ids, f"{driver} {name}: {ids} != {ref_ids}"
        worst = max(worst, float(np.abs(np.array(lps) - np.array(ref_lps)).max()))
    assert worst < 1e-3, f"{driver}: logprob differs by {worst}"
    print(f"{driver}: max logprob diff {worst:.2e}")
    # requests and tokens per adapter reach the observers under the adapter's name
    assert surge.lora.wait_idle(5)


def test_unknown_adapter_is_refused(served):
    _, surge = served
    with pytest.raises(UnknownAdapterError):
        asyncio.run(collect(surge, ids_request([1, 2], "nope")))


def test_eviction_unload_while_in_use_and_no_leak(served, setup):
    """More adapters than slots: loaded on demand, least recently used evicted, tokens still exact. An
    adapter unloaded while its request runs finishes that request, then leaves the bank empty."""
    driver, surge = served
    _, _, adapters = setup
    lora = surge.lora
    want = reference(setup)
    extra = {f"{n}-2": adapters[n][0] for n in ADAPTERS}  # three more names: six adapters on 3 slots
    for name, src in extra.items():
        lora.add(name, src)
    loads = lora.loads
    with compilations() as seen:
        for _ in range(2):
            got = asyncio.run(run_all(surge, PROMPTS[:3], [f"{n}-2" for n in ADAPTERS]))
            assert [g[0] for g in got] == [w[0] for w in want[:3]]
            got = asyncio.run(run_all(surge, PROMPTS[:3], list(ADAPTERS)))
            assert [g[0] for g in got] == [w[0] for w in want[:3]]
    assert seen == [], f"{driver}: a load or an eviction compiled: {seen}"
    assert lora.loads - loads == 12  # every round evicted the other three
    assert len(lora.resident()) == 3

    async def unload_while_running():
        task = asyncio.ensure_future(collect(surge, ids_request(PROMPTS[0], "sql-2")))
        while "sql-2" not in lora.running() + lora.waiting():
            await asyncio.sleep(0.001)
        lora.remove("sql-2")
        assert "sql-2" not in lora.names()
        with pytest.raises(UnknownAdapterError):  # new requests no longer find it
            await collect(surge, ids_request(PROMPTS[0], "sql-2"))
        return await task

    ids, _ = asyncio.run(unload_while_running())
    assert ids == want[0][0]
    for name in extra:
        if name in lora.names():
            lora.remove(name)
    assert lora.wait_idle(5)
    assert set(lora.resident()) <= set(ADAPTERS)  # the unloaded ones left no slot behind
    assert lora.names() == list(ADAPTERS)
    freed = [s for s in range(lora.max_loras) if s not in lora.resident().values()]
    for tree in lora.bank.trees:  # an emptied slot holds zeros: nothing of an unloaded adapter stays
        a = np.asarray(tree["model"]["layers"][0]["self_attn"]["q_proj"]["lora_a"][...])
        assert all(not a[s].any() for s in freed)
