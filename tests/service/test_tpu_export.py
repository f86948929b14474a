"""The engines' real programs, exported for TPU on this CPU machine: `jax.export` with
``platforms=("tpu",)`` of every program a TPU pod compiles at start (engines/program_inventory.py: the
job lists of the engines' own compile()), Mosaic calls included, for the default model (SmolLM2-135M,
its config read from the default model's GGUF) and the Llama-3.1-8B shape (int8 weights, bf16 KV), on
1, 4 and 8-chip meshes of v5e chips, both drivers.

The engines are built inside `tpu_lowering.targeting`, so every choice they make by backend is the TPU's
(models/target.py): decode blocks of 4, TPU row and prefill buckets, the flat dense reader, the TPU
sampler, per-channel int8 scales, the paged kernel with the v5e's block sizes. Their weights are
abstract (`loader.abstract_model`: shapes, dtypes and partition-rule shardings, nothing allocated), so
an 8B engine costs tracing only. Each exported module is checked for what the TPU path must show: the
Mosaic kernel exactly where the paged kernel runs, flat KV reads (no per-head view of the dense cache),
no CPU sampler, and the state's shardings as the engine keeps them.

Each (model, engine, mesh) exports one program of each kind (a kind: the name less its sizes; the same
code at another bucket size lowers the same way); `test_every_program_lowers_for_tpu` exports every
program of the inventory on 8 chips for the default model's vdriver (with and without n-gram speculation
and in-step prefill) and the 8B's paged engine. `FAST` names the cases make test-fast runs; the rest are
`slow` (make test, so every CI run).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from vsurge.engines.dense.vengine import GenerationState
from vsurge.engines.paged.oengine import PagedState
from vsurge.engines.program_inventory import Program, programs, state_spec
from vsurge.models import kernel_tables as kt
from vsurge.models import pallas_sharded as ps
from vsurge.models import tpu_lowering as tl
from vsurge.models.attention import read_chunk, use_dense_reader
from vsurge.models.config import ModelConfig
from vsurge.models.loader import abstract_model
from vsurge.models.sharding import make_mesh
from vsurge.models.target import target_backend
from vsurge.seed_api.engines import oEngine, vEngine

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8 or not ps.kernel_available(),
    reason="needs 8 (fake) devices and jax's ragged kernel",
)

SMOL, L8B = "smollm2-135m", "llama-3.1-8b"
LLAMA_31_8B = dict(  # Llama-3.1-8B's config.json (the shape; the weights are never read)
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
)
QUANTIZATION = {SMOL: "none", L8B: "int8"}
# the mesh a pod of that many chips runs: the paged layout splits whole query heads over tp (SmolLM2's 9
# do not split over 4 or 8), so its odriver pods put the chips on dp
MESHES = {
    (SMOL, "vdriver"): {1: None, 4: "tp=4", 8: "tp=8"},
    (SMOL, "odriver"): {1: None, 4: "dp=4", 8: "dp=8"},
    (L8B, "vdriver"): {1: None, 4: "tp=4", 8: "tp=8"},
    (L8B, "odriver"): {1: None, 4: "tp=4", 8: "tp=8"},
}
# the paged kernel takes the 8B's heads; SmolLM2's 6 combined kv heads do not tile for bf16 (pure JAX)
KERNEL = {SMOL: False, L8B: True}
# vdriver with n-gram speculation (single decode steps and the verify step) and prompts prefilled inside
# the decode steps (the mixed step): the programs the default configuration does not build
FEATURES = dict(speculative="ngram", max_num_batched_tokens=512)
ENGINES = {"vdriver": {}, "vdriver+features": FEATURES, "odriver": {}}


@functools.cache
def model_config(model: str) -> ModelConfig:
    if model == L8B:
        return ModelConfig.from_hf(LLAMA_31_8B, source="Llama-3.1-8B config")
    from vsurge.models.default_model import default_model_path
    from vsurge.models.gguf import read_gguf

    path = str(default_model_path())  # downloaded once ($VSURGE_CACHE_DIR); CI's serve stage fetched it
    return ModelConfig.from_hf(read_gguf(path).config, source=path)


@pytest.fixture(autouse=True)
def _unconfigured():
    yield
    ps.reset()  # oEngine's configure() sets the process's attention path


def build(
    model: str, engine: str, chips: int, generation: str = "v5e"
) -> tuple[vEngine | oEngine, ModelConfig]:
    """The engine a pod of ``chips`` chips of ``generation`` builds with no engine flags (plus the
    engine's extras), on abstract weights."""
    driver = engine.split("+")[0]
    spec = MESHES[(model, driver)][chips]
    mesh = make_mesh(spec) if spec else None
    cfg = model_config(model)
    with tl.targeting(generation, mesh):
        weights = abstract_model(cfg, mesh=mesh, quantization=QUANTIZATION[model])
        cls = vEngine if driver == "vdriver" else oEngine
        return cls(weights, None, mesh=mesh, **ENGINES[engine]), cfg


def kind(name: str) -> str:
    """A program's kind: its name less its sizes (a mixed step without chunk tokens is its own kind)."""
    return re.sub(r"(?<!\d)[1-9]\d*", "N", name)


def one_per_kind(progs: list[Program], skip: set[str] = frozenset()) -> list[Program]:
    out: dict[str, Program] = {}
    for p in progs:
        if kind(p.name) not in skip:
            out.setdefault(kind(p.name), p)
    return list(out.values())


def cache_readers(engine) -> list:
    """vEngine's programs that read the dense cache."""
    fns = [*engine._decode.values(), *engine._forward.values()]
    fns += [*engine.blocks.programs.values()] if engine.blocks else []
    fns += [*engine.speculator._fns.values()] if engine.speculator else []
    fns += [*engine.mixed._fns.values()] if engine.mixed else []
    return fns


def per_head_view(text: str, engine, cfg: ModelConfig) -> bool:
    """Whether the module views the whole dense cache per head ([S, M, KVH, D])."""
    return bool(re.search(rf"tensor<\d+x{engine.max_length}x{cfg.num_kv_heads}x{cfg.head_dim}x", text))


def per_head_chunks(text: str, cfg: ModelConfig) -> bool:
    """Whether the module views the dense cache per head a chunk at a time ([R, read_chunk, KVH, D]): the
    CPU's reader (a view of the whole cache, which XLA:CPU copies, is what issue 51 took out)."""
    return bool(re.search(rf"tensor<\d+x{read_chunk(None)}x{cfg.num_kv_heads}x{cfg.head_dim}x", text))


def flat_reads(text: str, cfg: ModelConfig) -> bool:
    """Whether the module reads flat rows a chunk at a time ([R, read_chunk, KVH * D]): the TPU's reader."""
    return bool(re.search(rf"tensor<\d+x{read_chunk(None)}x{cfg.num_kv_heads * cfg.head_dim}xbf16>", text))


def export(engine, prog: Program, generation: str = "v5e") -> jax.export.Exported:
    return tl.lower_for_tpu(prog.fn, *prog.args, generation=generation, mesh=engine.mesh)


def check(engine, cfg: ModelConfig, prog: Program, exported: jax.export.Exported, chips: int) -> None:
    """What the module of ``prog`` must show on the TPU path."""
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",) and exported.nr_devices == chips, prog.name
    kernel = isinstance(engine, oEngine) and ps.current().pallas and prog.fn in engine._mixed.values()
    assert tl.mosaic_kernels(text) == (["ragged_paged_attention_kernel"] if kernel else []), prog.name
    # the sampler's TPU form: the CPU's keeps its sort pattern with optimization barriers
    assert "optimization_barrier" not in text, prog.name
    if isinstance(engine, vEngine) and any(prog.fn is f for f in cache_readers(engine)):
        assert not per_head_view(text, engine, cfg), f"{prog.name}: a per-head view of the dense cache"
        assert not per_head_chunks(text, cfg), f"{prog.name}: the dense cache's chunks read per head"
        assert flat_reads(text, cfg), f"{prog.name}: no flat read of the dense cache"
    # the decode state goes in as the engine keeps it: shapes, dtypes and shardings
    shardings = exported.in_shardings_jax(engine.mesh) if engine.mesh is not None else None
    at = 0
    for arg in prog.args:
        leaves = jax.tree.leaves(arg)
        if isinstance(arg, GenerationState | PagedState):
            avals = exported.in_avals[at : at + len(leaves)]
            assert [(a.shape, a.dtype) for a in avals] == [(x.shape, x.dtype) for x in leaves], prog.name
            if shardings is not None:
                kept = jax.tree.leaves(engine.get_state_shardings(is_decode=True))
                got = shardings[at : at + len(leaves)]
                for g, k, x in zip(got, kept, leaves, strict=True):
                    assert g.is_equivalent_to(k, len(x.shape)), f"{prog.name}: {g} is not {k}"
        at += len(leaves)
    assert at == len(exported.in_avals), prog.name


def check_setup(engine, model: str, kind_of_engine: str) -> None:
    """What a TPU pod resolves with no engine flags (models/target.py), and the model's dtypes."""
    state = state_spec(engine)
    cache = jax.tree.leaves(state[0])[0]
    assert engine.model.dtype == jnp.bfloat16 and cache.dtype == jnp.bfloat16
    weights = {x.dtype for x in jax.tree.leaves(engine.params)}
    assert (jnp.dtype(jnp.int8) in weights) == (QUANTIZATION[model] == "int8")
    if QUANTIZATION[model] == "int8":  # per output channel on TPU: one scale group
        scales = [x for p, x in jax.tree_util.tree_leaves_with_path(engine.params) if "scale" in str(p)]
        assert scales and all(1 in x.shape for x in scales)
    assert engine.decode_rows == [8, 16]  # TPU row buckets for 16 slots (CPU: 1, 2, 4, 8, 16)
    if kind_of_engine == "odriver":
        setup = ps.current()
        assert setup.pallas == KERNEL[model], setup.reason
        assert not setup.pallas or (setup.kernel, setup.device_kind) == ("mosaic", "TPU v5 lite")
        return
    assert engine.prefill_lengths == [128, 256, 512, 1024]  # TPU buckets (CPU: from 32)
    features = kind_of_engine == "vdriver+features"
    assert engine.decode_steps == (1 if features else 4)  # decode blocks on TPU, single with n-gram drafts
    assert (engine.speculator is not None, engine.mixed is not None) == (features, features)


def run(model: str, engine_kind: str, chips: int, every: bool) -> list[str]:
    """Export ``engine_kind``'s programs (every one, or one of each kind) and check each; their names."""
    engine, cfg = build(model, engine_kind, chips)
    check_setup(engine, model, engine_kind)
    progs = programs(engine)
    if engine_kind == "vdriver+features":  # only what the default vdriver does not build
        seen = {kind(p.name) for p in programs(build(model, "vdriver", chips)[0])}
        progs = [p for p in progs if kind(p.name) not in seen]
    chosen = progs if every else one_per_kind(progs)
    with tl.targeting("v5e", engine.mesh):  # the arguments are read (and prefixes traced) for the TPU
        assert target_backend() == "tpu"
        for prog in chosen:
            check(engine, cfg, prog, export(engine, prog), chips)
    return [p.name for p in chosen]


def _case(model: str, engine: str, chips: int, slow: bool = False):
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(model, engine, chips, marks=marks, id=f"{model}-{engine}-{chips}chips")


# One program of each kind for every engine on every mesh (n-gram + mixed steps: on 8 chips); the fast set
# (make test-fast) is the default model's vdriver on 1 and 8 chips, its other engines and the 8B's paged
# kernel on one; the rest is slow (make test: every CI run)
FAST = {
    (SMOL, "vdriver", 1),
    (SMOL, "vdriver", 8),
    (SMOL, "vdriver+features", 8),
    (SMOL, "odriver", 1),
    (L8B, "odriver", 1),
}
# every program of the inventory on 8 chips: the default model's vdriver (the default pod) with and
# without its extras, and the 8B's paged kernel (its one-of-each-kind case on 8 chips is then left out)
# every program of the default path (the rest is covered kind by kind, to keep the suite inside its budget)
EVERY_CASES = [(SMOL, "vdriver")]
KIND_CASES = [
    _case(m, e, c, slow=(m, e, c) not in FAST)
    for m in (SMOL, L8B)
    for e in ENGINES
    for c in ((8,) if e == "vdriver+features" else (1, 8))
    if (m, e, c) != (L8B, "odriver", 8)
] + [_case(SMOL, "odriver", 4, slow=True), _case(L8B, "vdriver", 4, slow=True)]  # 4 chips: one per model
# kinds each engine must have built for a TPU (decode blocks, the kernel's two shape classes, ...)
MUST = {
    "vdriver": {
        "prefill bucket N: embed",
        "prefill bucket N: layer",
        "prefill bucket N: finish",
        "prefill rows NxN: layer",
        "decode block of N slots=N",
        "insert from prefill bucket N",
    },
    "vdriver+features": {"decode slots=N", "verify slots=N k=N", "mixed slots=N chunks=NxN"},
    "odriver": {
        "step rows=N + 0 chunk tokens",
        "step rows=N + N chunk tokens",
        "seat after a chunk",
        "masked sampler slots=N",
        "masked seat after a chunk",
    },
}


@pytest.mark.parametrize(("model", "engine", "chips"), KIND_CASES)
def test_each_kind_of_program_lowers_for_tpu(model, engine, chips):
    names = run(model, engine, chips, every=False)
    assert MUST[engine] <= {kind(n) for n in names}, names


@pytest.mark.slow
@pytest.mark.parametrize(("model", "engine"), EVERY_CASES)
def test_every_program_lowers_for_tpu(model, engine):
    names = run(model, engine, 8, every=True)
    assert len(names) > len(MUST[engine]) and MUST[engine] <= {kind(n) for n in names}


def test_the_checks_see_the_cpu_forms(monkeypatch):
    """The checks can fail: the same engine's programs traced with the CPU's forms show per-head views of
    the dense cache's chunks (never of the whole cache), no flat read, and the CPU sampler's barriers."""
    engine, cfg = build(SMOL, "vdriver", 1)
    progs = {p.name: p for p in programs(engine)}
    with tl.targeting("v5e", engine.mesh):
        with use_dense_reader("heads"):
            text = export(engine, progs["forward slots=8"]).mlir_module()
        # the CPU slices flat chunks too (flat_reads), then views each per head
        assert per_head_chunks(text, cfg) and not per_head_view(text, engine, cfg)
        monkeypatch.setenv("VSURGE_SAMPLER_IMPL", "cpu")
        assert "optimization_barrier" in export(engine, progs["masked sampler slots=8"]).mlir_module()


def test_the_target_backend_is_the_lowering_context():
    from vsurge.engines.dense.vengine import resolve_decode_steps
    from vsurge.engines.engine_base import default_prefill_lengths, row_buckets
    from vsurge.engines.sampling.ops import sampler_impl
    from vsurge.models.attention import dense_reader
    from vsurge.models.loader import resolve_dtype
    from vsurge.models.quantization import groups_for

    def choices():
        return (
            target_backend(),
            dense_reader(),
            sampler_impl(),
            resolve_decode_steps(None),
            row_buckets(64, 1),
            default_prefill_lengths(512),
            groups_for(4096),
            resolve_dtype(None),
        )

    cpu = ("cpu", "heads", "cpu", 1, [1, 2, 4, 8, 16, 32, 64], [32, 64, 128, 192, 256, 384, 512], 64, jnp.float32)
    tpu = ("tpu", "flat", "tpu", 4, [8, 32, 64], [128, 256, 512], 1, jnp.bfloat16)
    assert choices() == cpu
    with tl.targeting("v6e", "tp=4"):
        assert choices() == tpu
    assert choices() == cpu


def _scoped_vmem(text: str) -> list[int]:
    """The VMEM limit of each Mosaic call (its backend config's scoped memory size)."""
    return [int(x) for x in re.findall(r"scoped_memory_configs[^]]*?size\\22: (\d+)", text)]


@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e"])
def test_the_paged_steps_take_each_generations_table(generation):
    """The 8B's paged mixed steps built for each TPU generation: the kernel's VMEM limit (and block
    sizes) come from that generation's table (models/kernel_tables.py), by shape class: a decode-only
    step is a decode-class call, a step with chunk tokens a prefill-class one."""
    engine, _ = build(L8B, "odriver", 1, generation)
    table = kt.GENERATIONS[generation]
    setup = ps.current()
    assert setup.pallas and setup.device_kind == table.device_kinds[0], setup.reason
    steps = one_per_kind([p for p in programs(engine) if p.fn in engine._mixed.values()])
    assert len(steps) == 2
    with tl.targeting(generation, engine.mesh):
        for prog in steps:
            text = export(engine, prog, generation).mlir_module()
            cls = kt.DECODE if prog.name.endswith(" 0 chunk tokens") else kt.PREFILL
            assert tl.mosaic_kernels(text) == ["ragged_paged_attention_kernel"], prog.name
            assert _scoped_vmem(text) == [table.vmem_limit[cls]], prog.name
