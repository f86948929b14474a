"""The program inventory's abstract stand-ins are the real thing (engines/program_inventory.py,
loader.abstract_model): on a tiny checkpoint, the abstract model has the loaded model's parameters (paths,
shapes, dtypes, shardings; int8 scales included), `state_spec` the allocated decode state's, and every
program lowered on the inventory's abstract arguments is the module the engine's own arguments lower to
(compile()'s state and inputs, a real prefill's prefix). So exporting the inventory for a TPU
(test_tpu_export.py) exports the programs the engine runs.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import vsurge
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.engines.dense.warmup import chained
from vsurge.engines.dense.warmup import program_jobs as dense_jobs
from vsurge.engines.paged.programs import program_jobs as paged_jobs
from vsurge.engines.paged.programs import sampler_rows
from vsurge.engines.paged.structured_output import structured_jobs as paged_structured_jobs
from vsurge.engines.program_inventory import programs, state_spec
from vsurge.models.config import ModelConfig
from vsurge.models.loader import _read_config, abstract_model
from vsurge.models.sharding import make_mesh
from vsurge.seed_api.engines import oEngine, vEngine

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (fake) devices")

SMALL = dict(max_concurrent_decodes=4, max_length=64, prefill_lengths=[16, 32])


def _same(real, spec, what: str) -> None:
    """The leaves of ``real`` (arrays) and ``spec`` (ShapeDtypeStructs): the same tree, shapes, dtypes and
    shardings."""
    r, s = jax.tree_util.tree_leaves_with_path(real), jax.tree_util.tree_leaves_with_path(spec)
    assert [p for p, _ in r] == [p for p, _ in s], what
    for (path, a), (_, b) in zip(r, s, strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), f"{what} {jax.tree_util.keystr(path)}"
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), f"{what} {jax.tree_util.keystr(path)}"


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return path, ModelConfig.from_hf(_read_config(path))


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("spec", [None, "tp=2"])
def test_the_abstract_model_is_the_loaded_one(tiny, spec, quantization):
    path, cfg = tiny
    mesh = make_mesh(spec) if spec else None
    model, _ = vsurge.load_model(path, mesh=mesh, quantization=quantization)
    abstract = abstract_model(cfg, mesh=mesh, quantization=quantization)
    _same(nnx.state(model), nnx.state(abstract), "params")


@pytest.mark.parametrize("cls", [vEngine, oEngine])
@pytest.mark.parametrize("spec", [None, "tp=2"])
def test_the_state_spec_is_the_allocated_state(tiny, cls, spec):
    model, tok = vsurge.load_model(tiny[0])  # its own: an engine on a mesh places the model's weights
    engine = cls(model, tok, mesh=spec, **SMALL)
    _same(engine.init_decode_state(), state_spec(engine), "state")


def _lowered(fn, args) -> str:
    return fn.lower(*args).as_text()


@pytest.mark.parametrize("cls", [vEngine, oEngine])
def test_the_inventory_lowers_as_the_engine_calls(tiny, cls):
    """Each program on the inventory's abstract arguments lowers to the module of the engine's own call:
    compile()'s job list on the allocated state, (oEngine) warm_structured's masked programs, and
    (vEngine) insert and the first-token samplers on a prefix a real prefill returned."""
    model, tok = vsurge.load_model(tiny[0])
    engine = cls(model, tok, **SMALL)
    inventory = {p.name: p for p in programs(engine)}
    state = engine.init_decode_state()
    if cls is oEngine:
        rep = engine._replicated()
        inputs = engine.seq_inputs(
            SamplingParams(temperature=0.0, max_tokens=1), [], np.zeros(2, np.uint32), [0]
        )
        table = jax.device_put(np.zeros((engine.max_concurrent_decodes, engine.table_width), np.int32), rep)
        place = lambda shape, dt: jax.device_put(np.zeros(shape, dt), rep)  # noqa: E731
        real = paged_jobs(engine, state, inputs, table, place)
        # what warm_structured adds: the masked samplers and seat, on the state less its pages
        v = engine.model_config.vocab_size
        dec = [place((r, v), np.float32) for r in engine.step_rows]
        pf = [place((engine.step_seqs, v), np.float32)]
        real += paged_structured_jobs(engine, sampler_rows(state), dec, pf, inputs)
    else:
        real = chained(engine, dense_jobs(engine, state))  # each prefill: its chain's three programs
        # the chain's layer and finish on what a real call of the program before each returns
        chain, inner = engine._prefill, engine.prefill_params["model"]
        tokens, positions, segments, totals, starts, lens, words, sampling = engine._pack(
            [[1, 2, 3]], [SamplingParams(temperature=0.0, max_tokens=1)], None
        )
        x, pos, seg, tot, lora = chain._embed(
            inner["embed_tokens"], tokens, positions, segments, totals, None
        )
        layer = (inner["layers"][1], x, pos, seg, tot, lora)
        h = chain._layer(*layer)[0]
        real += [
            ("prefill bucket 16: layer", chain._layer, layer),
            (
                "prefill bucket 16: finish",
                chain._finish,
                (inner["norm"], h, starts, lens, words, sampling),
            ),
        ]
        prefix = engine.prefill([1, 2, 3])
        key, j = np.zeros(2, np.uint32), np.int32(0)
        head = (engine.params, prefix.hidden, prefix.sampling, prefix.prompt_mask)
        real += [
            ("insert from prefill bucket 16", engine._insert, (prefix, state, j, j, key, j)),
            ("first token", engine._first, (*head, j, key)),
        ]
    assert {name for name, _, _ in real} <= set(inventory)
    for name, fn, args in real:
        assert inventory[name].fn is fn, name
        assert _lowered(fn, inventory[name].args) == _lowered(fn, args), name
