"""The layer scan (layer_scan=on: weights and KV cache stacked over layers, models/layer_stack.py).

The forward gives the same hidden states and K/V in each of its forms (one cache per layer, a stacked
cache over unrolled layers, the scan); stacking and unstacking keep every weight and its sharding; and a
vdriver engine with the scan serves every feature (packed and chunked prefill, decode blocks, n-gram
speculation, mixed steps, seeded sampling with logprobs, n > 1, penalties, prompt logprobs, structured
output) with the tokens and logprobs of the unrolled engine, compiling nothing on live requests.
"""

from __future__ import annotations

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from jit_watch import compilations, live_mix

import vsurge
from vsurge.models.attention import ChunkAttention, DenseDecodeAttention, PrefillAttention, to_flat
from vsurge.models.config import ModelConfig
from vsurge.models.kv_stack import NO_CACHE, StackedKV
from vsurge.models.layer_stack import is_stacked, stack_layers, unstack_layers
from vsurge.models.llama import LlamaForCausalLM
from vsurge.models.sharding import make_mesh, place_params
from vsurge.structured import GrammarCompiler, GrammarSpec
from vsurge.surge import vSurge

CFG = ModelConfig(
    model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=8,
)  # fmt: skip


def _model(cfg=CFG, seed=0):
    return LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))


def _forms(model, tokens, positions, lengths):
    """Prefill then one decode step, through the forward given the model as it is (stacked or not):
    with one cache per layer, and with the stacked cache."""
    b, t = tokens.shape
    m, f = 16, CFG.num_kv_heads * CFG.head_dim
    meta = (positions, lengths)
    out = {}
    h, kv = model(tokens, positions, PrefillAttention(), [None] * CFG.num_layers, meta)
    h2, skv = model(tokens, positions, PrefillAttention(), NO_CACHE, meta)
    out["prefill"] = (h, jnp.stack([k for k, _ in kv]), h2, skv.k)
    rows = [
        (jnp.zeros((b, m, f)).at[:, :t].set(to_flat(k)), jnp.zeros((b, m, f)).at[:, :t].set(to_flat(v)))
        for k, v in kv
    ]
    pos = lengths
    step = (tokens[:, :1], pos[:, None], DenseDecodeAttention(), None, (pos, pos + 1))
    hd, new = model(*step[:3], rows, step[4])
    stacked = StackedKV(jnp.stack([r[0] for r in rows], 1), jnp.stack([r[1] for r in rows], 1))
    hd2, new2 = model(*step[:3], stacked, step[4])
    out["decode"] = (hd, jnp.stack([c[0] for c in new], 1), hd2, new2.k)
    return out


def test_every_form_of_the_forward_agrees():
    model = _model()
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    lengths = jnp.asarray([6, 4], jnp.int32)
    unrolled = _forms(model, tokens, positions, lengths)
    assert stack_layers(model) and is_stacked(model)
    assert not stack_layers(model)  # already stacked
    graphdef, state = nnx.split(model)
    scanned = jax.jit(lambda s: _forms(nnx.merge(graphdef, s), tokens, positions, lengths))(state)
    text = (
        jax.jit(lambda s: _forms(nnx.merge(graphdef, s), tokens, positions, lengths)).lower(state).as_text()
    )
    assert re.search(r"stablehlo\.while", text), "the stacked model's forward is not a loop"
    for name in ("prefill", "decode"):
        ref = unrolled[name][0]
        for got in (*unrolled[name][2:3], scanned[name][0], scanned[name][2]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
        for got in (unrolled[name][3], scanned[name][1], scanned[name][3]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(unrolled[name][1]), rtol=1e-5, atol=1e-5)


def test_a_chunk_writes_its_layer_of_a_stacked_row():
    rng = np.random.RandomState(1)
    q, k, v = (jnp.asarray(rng.randn(1, 4, n, 8), jnp.float32) for n in (4, 2, 2))
    rows = [(jnp.asarray(rng.randn(12, 2, 8), jnp.float32),) * 2 for _ in range(3)]
    positions = (jnp.arange(4) + 3)[None]
    want, (kw, _) = ChunkAttention()(q, k, v, rows[1], (positions, 3))
    stacked = (jnp.stack([r[0] for r in rows]), jnp.stack([r[1] for r in rows]))
    got, new = ChunkAttention()(q, k, v, _layer(stacked, 1), (positions, 3))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(new.k[1]), np.asarray(kw))
    np.testing.assert_array_equal(np.asarray(new.k[0]), np.asarray(stacked[0][0]))  # other layers untouched


def _layer(stacked, i):
    from vsurge.models.kv_stack import LayerKV

    return LayerKV(stacked[0], stacked[1], i)


def test_stacking_keeps_every_weight_and_its_sharding():
    mesh = make_mesh("tp=2", jax.devices()[:2]) if len(jax.devices()) >= 2 else None
    model = _model(seed=3)
    before = {
        "/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))
    }
    stack_layers(model)
    graphdef, state = nnx.split(model)
    flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    q = flat["model/layers/stacked/self_attn/q_proj/kernel"]
    assert q.shape == (CFG.num_layers, CFG.hidden_size, CFG.num_heads * CFG.head_dim)
    for i in range(CFG.num_layers):
        np.testing.assert_array_equal(np.asarray(q[i]), before[f"model/layers/{i}/self_attn/q_proj/kernel"])
    if mesh is not None:  # placed on a mesh: each layer split as the rules split one
        placed = place_params(state, CFG, mesh)
        flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(placed)}
        assert flat["model/layers/stacked/self_attn/q_proj/kernel"].sharding.spec == P(None, None, "tp")
        assert flat["model/layers/stacked/mlp/down_proj/kernel"].sharding.spec == P(None, "tp", None)
        model = nnx.merge(graphdef, placed)
    assert unstack_layers(model) and not is_stacked(model) and not unstack_layers(model)
    after = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    assert after.keys() == before.keys()
    for name, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[name]), value)
    if mesh is not None:
        assert after["model/layers/2/self_attn/q_proj/kernel"].sharding.spec == P(None, "tp")


# ------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


FEATURES = {
    "blocks": dict(decode_steps=4),
    "ngram": dict(speculative="ngram", num_speculative_tokens=3),
    "mixed": dict(max_num_batched_tokens=48, decode_steps=1),
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"


def _serve(tiny, scan: str, features: dict, structured: bool) -> tuple[list, list]:
    """The live mix (and, when asked, a regex-constrained request) on a fresh model's vdriver."""
    model, tok = tiny
    model = nnx.merge(*nnx.split(model))  # its own module tree: stacking one engine's leaves the other's
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=4, prefill_lengths=[16, 64], max_length=128,
        layer_scan=scan, **features,
    )  # fmt: skip
    s.compile()
    engine = s.driver.engines[0]
    assert engine.layer_scan == (scan == "on") and is_stacked(model) == (scan == "on")
    reqs = live_mix()
    compiler = None
    if structured:
        compiler = GrammarCompiler(tok, model.config.vocab_size, engine.eos_token_ids)
        grammar = compiler.compile(GrammarSpec.regex(REGEX))
        reqs.append(
            vsurge.request.vSurgeRequest(
                prompt=[9, 8, 7], max_tokens=12, temperature=1.0, seed=5, grammar=grammar,
                is_client_side_tokenization=True,
            )
        )  # fmt: skip
        engine.warm_structured()
    with compilations() as compiled:
        s.start()
        try:
            actives = [s.submit(r) for r in reqs]
            outs = []
            for a in actives:  # per sample: its tokens and logprobs, however the deltas cut them
                out: dict[int, tuple[list, list]] = {}
                for items in a.channel:
                    for x in items:
                        ids, lps = out.setdefault(x.index, ([], []))
                        ids += x.token_ids
                        lps += [(lp.token_id, round(lp.logprob, 4)) for lp in x.logprobs or []]
                outs.append(sorted(out.items()))
        finally:
            s.stop()
            if compiler is not None:
                compiler.close()
    return outs, compiled


@pytest.mark.parametrize("name", list(FEATURES))
def test_the_scanned_engine_serves_every_feature_as_the_unrolled_one(tiny, name):
    structured = name == "blocks"
    got, compiled = _serve(tiny, "on", FEATURES[name], structured)
    assert not compiled, f"compiled on live requests: {compiled}"
    want, _ = _serve(tiny, "off", FEATURES[name], structured)
    assert got == want
    assert all(out and all(ids for _, (ids, _) in out) for out in got)


def test_the_scan_is_asked_for_on_vdriver_without_lora():
    # off by default (on a v5e the scanned decode step ran ~20% slower: docs/performance.md)
    assert vsurge.EngineConfig().layer_scan == "off"
    with pytest.raises(ValueError, match="layer_scan"):
        vsurge.EngineConfig(driver="odriver", layer_scan="on")
    with pytest.raises(ValueError, match="layer_scan"):
        vsurge.EngineConfig(layer_scan="on", enable_lora=True)


def test_a_model_another_engine_stacked_serves_a_paged_engine(tiny):
    model, tok = tiny
    model = nnx.merge(*nnx.split(model))
    cfg = replace(vsurge.EngineConfig(), max_concurrent_decodes=2, max_length=64, prefill_lengths=[16])
    dense = vSurge.create(model, tok, replace(cfg, driver="vdriver", layer_scan="on"))
    assert is_stacked(model)
    del dense
    paged = vSurge.create(model, tok, replace(cfg, driver="odriver"))
    assert not is_stacked(model) and paged.driver.engines[0].layer_scan is False
