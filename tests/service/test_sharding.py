"""Sharded equals unsharded on 8 fake CPU devices (set up in tests/conftest.py)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vsurge
from vsurge.models import greedy_generate, logits
from vsurge.models.sharding import LLAMA_RULES, make_mesh, parse_mesh_spec, spec_for


def test_eight_fake_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("spec", ["tp=2", "tp=4", "dp=2,tp=4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_equals_unsharded(tiny_checkpoint, arch, spec):
    path, _ = tiny_checkpoint(arch, heads=8, kv_heads=4)
    plain, _ = vsurge.load_model(path)
    sharded, _ = vsurge.load_model(path, mesh=spec)
    q = sharded.model.layers[0].self_attn.q_proj.kernel[...]
    assert isinstance(q.sharding, NamedSharding) and q.sharding.spec == P(None, "tp")
    tp = parse_mesh_spec(spec)["tp"]
    # each device holds only its slice: no full copy on every device
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // tp)}
    ids = np.random.RandomState(0).randint(0, 320, (4, 12))
    np.testing.assert_allclose(logits(sharded, ids), logits(plain, ids), rtol=1e-4, atol=1e-4)
    prompts = [list(ids[0]), list(ids[1][:5])]
    assert greedy_generate(sharded, prompts, 16) == greedy_generate(plain, prompts, 16)


def test_mesh_spec_parsing():
    assert parse_mesh_spec("dp=2,tp=4") == {"dp": 2, "tp": 4}
    assert parse_mesh_spec(None) == {"dp": 1, "tp": 1}
    assert make_mesh("tp=8").shape == {"dp": 1, "tp": 8}
    for bad in ("tp=0", "xp=2", "tp", "tp=two"):
        with pytest.raises(ValueError, match="mesh spec"):
            parse_mesh_spec(bad)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh("dp=4,tp=4")


def test_rules_skip_axes_that_do_not_divide():
    mesh = make_mesh("tp=4")
    assert spec_for("model/layers/0/self_attn/k_proj/kernel", (64, 32), mesh, LLAMA_RULES) == P(None, "tp")
    assert spec_for("model/layers/0/self_attn/k_proj/kernel", (64, 6), mesh, LLAMA_RULES) == P(None, None)
    assert spec_for("model/norm/weight", (64,), mesh, LLAMA_RULES) == P(None)


class _Recorded(np.ndarray):
    """A tensor that notes every slice read from it (as a memory map would be read)."""

    reads: list

    def __getitem__(self, index):
        if isinstance(self.base, _Recorded) or not hasattr(self, "reads"):
            return super().__getitem__(index)
        self.reads.append(np.asarray(super().__getitem__(index)).shape)
        return super().__getitem__(index)


def test_placement_reads_each_devices_shard_alone(tiny_checkpoint):
    """The loader reads a tensor shard by shard (what a process of a multi-host group needs: only its
    devices' slices), never whole, and places it without jax.device_put's cross-process check."""
    from vsurge.models.loader import held_bytes, place

    mesh = make_mesh("tp=4")
    host = np.arange(32 * 16, dtype=np.float32).reshape(32, 16).view(_Recorded)
    host.reads = []
    arr = place(host, NamedSharding(mesh, P(None, "tp")), np.float32)
    assert host.reads and set(host.reads) == {(32, 4)}  # 4 column shards, no read of the whole
    np.testing.assert_array_equal(np.asarray(arr), np.asarray(host))
    # a single device still gets the whole tensor
    one = place(np.ones((3, 2), np.float32), jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert one.shape == (3, 2)

    model, _ = vsurge.load_model(tiny_checkpoint("llama", heads=8, kv_heads=4)[0], mesh="tp=4")
    local, total = held_bytes(model)
    assert local == total  # one process: each distinct shard of every parameter is here, counted once


def test_dense_engine_says_when_kv_heads_do_not_split(tiny_checkpoint, caplog):
    from vsurge.seed_api.engines import vEngine

    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=2)
    model, tok = vsurge.load_model(path, mesh="tp=4")
    with caplog.at_level("WARNING", logger="vsurge.engines.dense.vengine"):
        vEngine(model, tok, max_concurrent_decodes=2, prefill_lengths=[32], max_length=64, mesh="tp=4")
    assert "2 kv heads do not split over tp=4" in caplog.text
