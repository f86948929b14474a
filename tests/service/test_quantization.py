"""int8 weight-only quantization (models/quantization.py): accuracy against float32, memory, the compiled
decode step reading int8 (no float copy of a weight), shardings, GGUF Q8_0 kept as stored, and the engine."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import vsurge
from vsurge.models import quantization, reference
from vsurge.models.attention import DenseDecodeAttention


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def agreement(base: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """(teacher-forced top-1 agreement, mean KL(base || other) per token) of two logits [T, V]."""
    p, q = _log_softmax(base.astype(np.float32)), _log_softmax(other.astype(np.float32))
    kl = (np.exp(p) * (p - q)).sum(-1)
    return float((base.argmax(-1) == other.argmax(-1)).mean()), float(kl.mean())


def weight_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# --------------------------------------------------------------------------------------- the numerics


def test_per_channel_round_trip():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 48)).astype(np.float32) * rng.uniform(0.01, 3, size=(1, 48)).astype(np.float32)
    w[:, 5] = 0.0  # an all-zero channel stays zero
    q, scale = quantization.quantize(w, axis=0)
    assert q.dtype == jnp.int8 and scale.shape == (1, 48)
    assert int(jnp.abs(q).max()) == 127
    back = np.asarray(quantization.dequantize(q, scale, 0, jnp.float32))
    assert np.all(np.abs(back - w) <= np.asarray(scale) / 2 + 1e-7)
    assert np.all(back[:, 5] == 0)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(quantization.int8_matmul(jnp.asarray(x), q, scale)), x @ back, rtol=2e-5, atol=2e-5
    )


def test_grouped_round_trip_and_group_counts():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(256, 40)).astype(np.float32)
    w[:64] *= 50.0  # an outlier group: with one scale per channel, the other groups would lose precision
    q, scale = quantization.quantize(w, axis=0, groups=4)
    assert scale.shape == (4, 40)
    back = np.asarray(quantization.dequantize(q, scale, 0, jnp.float32))
    per_group = np.repeat(np.asarray(scale), 64, axis=0)
    assert np.all(np.abs(back - w) <= per_group / 2 + 1e-6)
    _, one = quantization.quantize(w, axis=0)
    assert np.abs(back[64:] - w[64:]).max() < 0.1 * float(np.asarray(one).min())  # finer than per channel
    emb_q, emb_s = quantization.quantize(w.T, axis=1, groups=4)  # the embedding layout, rows x groups
    assert emb_s.shape == (40, 4) and np.array_equal(np.asarray(emb_q), np.asarray(q).T)
    assert quantization.groups_for(576) == 9 and quantization.groups_for(576, shards=3) == 9
    assert quantization.groups_for(576, shards=2) == 1  # a device would hold half a group: per channel
    assert quantization.groups_for(100) == 1
    assert quantization.groups_for(576, backend="tpu") == 1  # TPU: per channel, fused into the matmul


def test_group_scales_and_cpu_tiles_match_the_plain_matmul():
    # groups of the contraction axis (GGUF Q8_0's blocks) and a weight bigger than one CPU tile
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.integers(-127, 128, size=(256, 1024)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, size=(8, 1024)), jnp.float32)
    assert quantization.TILE_BYTES < 256 * 1024 * 4
    x = jnp.asarray(rng.normal(size=(2, 5, 256)), jnp.float32)
    want = np.asarray(x) @ np.asarray(quantization.dequantize(q, scale, 0, jnp.float32))
    np.testing.assert_allclose(np.asarray(quantization.int8_matmul(x, q, scale)), want, rtol=1e-4, atol=1e-4)
    # the embedding layout [vocab, hidden] contracted over hidden (a tied lm_head)
    emb_q, emb_s = q.T, scale.T
    np.testing.assert_allclose(
        np.asarray(quantization.int8_matmul(x, emb_q, emb_s, axis=1)), want, rtol=1e-4, atol=1e-4
    )
    rows = np.asarray(quantization.embed_rows(emb_q, emb_s, jnp.asarray([[3, 7]]), jnp.float32))
    np.testing.assert_allclose(
        rows[0], np.asarray(quantization.dequantize(emb_q, emb_s, 1, jnp.float32))[[3, 7]]
    )


def test_unknown_quantization_is_refused(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="unsupported quantization 'int4'"):
        vsurge.load_model(path, quantization="int4")


# --------------------------------------------------------------------------------------- a tiny model

# Big enough that most weights exceed one CPU tile (TILE_BYTES of float32), so the HLO check has teeth.
BIG = dict(hidden=384, vocab=2048, layers=2, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def tied_pair(tiny_checkpoint):
    path, _ = tiny_checkpoint("tied", **BIG)
    f32, _ = vsurge.load_model(path)
    int8, _ = vsurge.load_model(path, quantization="int8")
    return path, f32, int8


def test_tiny_model_accuracy_and_memory(tied_pair, tiny_checkpoint):
    _, f32, int8 = tied_pair
    layer = int8.model.layers[0]
    gate = layer.mlp.gate_proj
    assert gate.kernel[...].dtype == jnp.int8
    assert gate.scale[...].shape == (384 // quantization.GROUP_SIZE, 768)  # per channel, groups of 64 inputs
    assert int8.model.embed_tokens.embedding[...].dtype == jnp.int8 and int8.lm_head is None  # tied
    ids = np.random.RandomState(0).randint(0, BIG["vocab"], (1, 200))
    top1, kl = agreement(reference.logits(f32, ids)[0], reference.logits(int8, ids)[0])
    assert top1 >= 0.9 and kl < 1e-3, (top1, kl)  # random weights: near-flat logits, many near-ties
    # weights: int8 + float32 scales + norms ~ a quarter of float32, about half of bfloat16
    path, _ = tiny_checkpoint("tied", **BIG)
    bf16, _ = vsurge.load_model(path, dtype="bfloat16")
    ratio = weight_bytes(int8) / weight_bytes(bf16)
    assert 0.48 < ratio < 0.55, ratio
    # a bf16 activation dtype works on the same int8 weights
    int8_bf16, _ = vsurge.load_model(path, dtype="bfloat16", quantization="int8")
    assert abs(weight_bytes(int8_bf16) - weight_bytes(int8)) < 0.01 * weight_bytes(int8)  # norms' dtype only
    top1, _ = agreement(reference.logits(bf16, ids)[0], reference.logits(int8_bf16, ids)[0])
    assert top1 >= 0.9


def _float_shapes(hlo: str) -> set[str]:
    """Every float array shape an instruction of a compiled module produces, e.g. 'f32[384,768]'."""
    return set(re.findall(r"=\s*((?:f32|bf16|f16)\[[0-9,]+\])", hlo))


def test_compiled_decode_step_reads_int8_weights(tied_pair):
    _, f32, int8 = tied_pair
    cfg = int8.config
    graphdef, state = nnx.split(int8)

    def step(state, caches, tokens, positions):
        model = nnx.merge(graphdef, state)
        backend = DenseDecodeAttention(window=cfg.sliding_window)
        hidden, caches = model(tokens[:, None], positions[:, None], backend, caches, positions)
        return jnp.argmax(model.compute_logits(hidden[:, 0]), axis=-1), caches

    b, length = 4, 64
    kv = jnp.zeros((b, length, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    caches = [(kv, kv)] * cfg.num_layers
    tokens, positions = jnp.zeros((b,), jnp.int32), jnp.full((b,), 3, jnp.int32)
    compiled = jax.jit(step).lower(state, caches, tokens, positions).compile()
    hlo = compiled.as_text()
    weights = {
        "/".join(map(str, k)): v.get_value()
        for k, v in nnx.to_flat_state(state)
        if v.get_value().dtype == jnp.int8
    }
    assert len(weights) == 1 + 7 * cfg.num_layers  # the (tied) embedding and every linear layer
    produced = _float_shapes(hlo)
    checked = 0
    for name, w in weights.items():
        assert f"s8[{','.join(map(str, w.shape))}]" in hlo, name  # the program takes the int8 weight
        if w.size * 4 > quantization.TILE_BYTES:  # smaller weights are a single tile
            full = f"f32[{','.join(map(str, w.shape))}]"
            assert full not in produced, f"{name}: a float32 copy {full} is materialized"
            checked += 1
    assert checked >= 1 + 3 * cfg.num_layers  # embedding, q_proj, gate/up/down (and o_proj) of each layer
    mem = compiled.memory_analysis()
    biggest = max(w.size for w in weights.values()) * 4
    assert mem.temp_size_in_bytes < biggest, (mem.temp_size_in_bytes, biggest)
    # the float32 program's arguments are four times the int8 one's weights
    assert mem.argument_size_in_bytes < weight_bytes(f32) / 2


def test_sharded_int8_weights_shard_like_the_weights(tiny_checkpoint):
    # hidden 256, intermediate 512: 4 and 8 groups of 64 inputs, whole groups on each of 4 devices, so the
    # sharded model is quantized exactly as the single-device one
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4, hidden=256)
    plain, _ = vsurge.load_model(path, quantization="int8")
    sharded, _ = vsurge.load_model(path, mesh="tp=4", quantization="int8")
    attn = sharded.model.layers[0].self_attn
    assert attn.q_proj.kernel[...].sharding.spec == P(None, "tp")
    assert attn.q_proj.scale[...].sharding.spec == P(None, "tp")
    assert attn.o_proj.kernel[...].sharding.spec == P("tp", None)
    o_scale = attn.o_proj.scale[...]
    assert o_scale.shape == (4, 256) and o_scale.sharding.spec == P("tp", None)  # groups split with `in`
    assert sharded.model.embed_tokens.embedding[...].sharding.spec == P("tp", None)
    assert sharded.model.embed_tokens.scale[...].sharding.spec == P("tp", None)
    assert sharded.lm_head.scale[...].sharding.spec == P(None, "tp")
    q = attn.q_proj.kernel[...]
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 4)}
    ids = np.random.RandomState(0).randint(0, 320, (2, 12))
    np.testing.assert_allclose(
        reference.logits(sharded, ids), reference.logits(plain, ids), rtol=1e-4, atol=1e-4
    )


def test_gguf_q8_0_is_kept_as_stored(tmp_path):
    import gguf
    from test_gguf import Tiny, random_weights, write_gguf

    c = Tiny()
    path = write_gguf(tmp_path / "m.gguf", c, random_weights(c), qtype=gguf.GGMLQuantizationType.Q8_0)
    f32, _ = vsurge.load_model(path)
    int8, _ = vsurge.load_model(path, quantization="int8")
    from vsurge.models.gguf import read_gguf

    stored_q, stored_scale = read_gguf(path).tensors.int8_blocks("model.layers.0.self_attn.q_proj.weight")
    k = int8.model.layers[0].self_attn.q_proj
    np.testing.assert_array_equal(np.asarray(k.kernel[...]), stored_q.T)  # the file's int8, un-permuted
    np.testing.assert_array_equal(np.asarray(k.scale[...]), stored_scale.T)  # its f16 block scales
    assert k.scale[...].shape == (c.hidden // 32, stored_q.shape[0])
    # q * d is exactly what the float32 load dequantizes: the same model
    np.testing.assert_allclose(
        np.asarray(quantization.dequantize(k.kernel[...], k.scale[...], 0, jnp.float32)),
        np.asarray(f32.model.layers[0].self_attn.q_proj.kernel[...]),
        rtol=1e-6,
        atol=1e-7,
    )
    ids = np.random.RandomState(0).randint(0, c.vocab, (1, 16))
    np.testing.assert_allclose(reference.logits(int8, ids), reference.logits(f32, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("driver", ["vdriver", "odriver"])
def test_engine_serves_int8_weights(tiny_checkpoint, driver):
    from vsurge import vSurge
    from vsurge.seed_api.request import vSurgeRequest

    path, _ = tiny_checkpoint("llama")
    model, tok = vsurge.load_model(path, quantization="int8")
    prompt = [5, 17, 42, 9, 100, 3]
    want = reference.greedy_generate(model, [prompt], 8)[0]
    cfg = vsurge.EngineConfig(
        driver=driver,
        max_concurrent_decodes=2,
        max_length=64,
        prefill_lengths=(16,),
        page_size=16,
        kv_cache_bytes=1 << 20,
        quantization="int8",
    )
    s = vSurge.create(model, tok, cfg)
    s.start()
    try:
        req = vSurgeRequest(
            prompt=prompt, max_tokens=8, temperature=0.0, ignore_eos=True, is_client_side_tokenization=True
        )
        got = [t for items in s.submit(req).channel for out in items for t in out.token_ids]
    finally:
        s.stop()
    assert got == want


# --------------------------------------------------------------------------------------- the default model

PROSE = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night the keeper "
    "climbed the narrow stairs, trimmed the wick and wound the clockwork that turned the great lens. Ships "
    "passing in the dark saw the beam sweep across the water and knew where the rocks were. In the winter the "
    "storms were fierce, and the wind pulled at the shutters until the whole tower seemed to hum. The keeper "
    "kept a logbook in which he wrote the weather, the ships he saw and the small events of his days: a seal "
    "on the rocks, a gull with a broken wing, the first frost on the grass. When the lamp was finally replaced "
    "by an electric light that needed no keeper, the logbooks were sent to the town museum, where children now "
    "read them and try to imagine the long nights alone above the sea. Scientists later used the same notes to "
    "study how the climate of the coast had changed, because few other records from that time were so careful "
    "and so complete. Many people who visit the museum say that the simple entries move them more than any "
    "painting. They describe a life of patience and attention, of small duties done well, and of a quiet pride "
    "in keeping others safe. Today the tower is open in summer, and visitors can climb the stairs, look out "
    "over the bay and read a copy of the final entry, written on the night the keeper left: the light is "
    "burning, the sea is calm, and all is well."
)


@pytest.mark.slow
def test_default_model_int8_against_float32():
    """SmolLM2-135M-Instruct: teacher-forced top-1 agreement and KL of int8 against float32 over a passage of
    prose and the model's own greedy answer to a chat prompt; weights about half of bfloat16."""
    f32, tok = vsurge.load_model("default")
    int8, _ = vsurge.load_model("default", quantization="int8")
    bf16, _ = vsurge.load_model("default", dtype="bfloat16")
    assert 0.45 < weight_bytes(int8) / weight_bytes(bf16) < 0.55
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tok(chat)["input_ids"]
    answer = prompt + reference.greedy_generate(f32, [prompt], 256)[0]
    texts = [tok(PROSE)["input_ids"], answer]
    agree, kls = [], []
    for ids in texts:
        base, other = reference.logits(f32, [ids])[0], reference.logits(int8, [ids])[0]
        agree.append(base.argmax(-1) == other.argmax(-1))
        p, q = _log_softmax(base), _log_softmax(other)
        kls.append((np.exp(p) * (p - q)).sum(-1))
    top1, kl = float(np.concatenate(agree).mean()), float(np.concatenate(kls).mean())
    print(f"int8 vs float32 over {sum(map(len, texts))} tokens: top-1 {top1:.4f}, mean KL {kl:.5f}")
    assert top1 >= 0.98 and kl < 0.01, (top1, kl)
