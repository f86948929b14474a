"""spec.engine's options: which ``vsurge serve`` variable each key sets, its kind, choices, range and driver.

Generated from vsurge's EngineConfig (tools/docgen/engine_crd.py, run by ``python tools/gen_docs.py``), which
writes the CRD's ``spec.engine`` from the same fields: the operator imports no vsurge (its image has no
jax), yet parses (spec.EngineSpec), checks (validation.py) and renders (manifests.env) exactly the options
the server has. A new serve knob reaches InferenceModels by regenerating; nothing here is edited by hand
but the record below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineOption:
    """One key of spec.engine. ``env`` None: passed as a flag (the LoRA bank's, see adapters.args).
    ``kind``: string, integer, number, or integers (a list; ``minimum``/``maximum`` bound each item).
    ``only``: the driver the option needs unless its value is one of ``idle``; ``what`` it changes there."""

    key: str
    field: str
    env: str | None
    kind: str
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    only: str | None = None
    idle: tuple[Any, ...] = ()
    what: str | None = None


# BEGIN GENERATED: engine-options (do not edit; regenerate with `python tools/gen_docs.py`)
DEFAULT_DRIVER = "vdriver"
OPTIONS: tuple[EngineOption, ...] = (
    EngineOption(
        key="driver",
        field="driver",
        env="VSURGE_DRIVER",
        kind="string",
        choices=("vdriver", "odriver"),
    ),
    EngineOption(
        key="maxConcurrentDecodes",
        field="max_concurrent_decodes",
        env="VSURGE_MAX_CONCURRENT_DECODES",
        kind="integer",
        minimum=1,
        maximum=4096,
    ),
    EngineOption(
        key="maxConcurrentPrefill",
        field="max_concurrent_prefill",
        env="VSURGE_MAX_CONCURRENT_PREFILL",
        kind="integer",
        minimum=1,
    ),
    EngineOption(
        key="maxLength",
        field="max_length",
        env="VSURGE_MAX_LENGTH",
        kind="integer",
        minimum=16,
        maximum=1048576,
    ),
    EngineOption(
        key="prefillLengths",
        field="prefill_lengths",
        env="VSURGE_PREFILL_LENGTHS",
        kind="integers",
        minimum=16,
        maximum=1048576,
    ),
    EngineOption(
        key="seed",
        field="seed",
        env="VSURGE_SEED",
        kind="integer",
    ),
    EngineOption(
        key="mesh",
        field="mesh",
        env="VSURGE_MESH",
        kind="string",
    ),
    EngineOption(
        key="pageSize",
        field="page_size",
        env="VSURGE_PAGE_SIZE",
        kind="integer",
        choices=(8, 16, 32, 64, 128, 256, 512, 1024),
    ),
    EngineOption(
        key="hbmUtilization",
        field="hbm_utilization",
        env="VSURGE_HBM_UTILIZATION",
        kind="number",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
    ),
    EngineOption(
        key="attention",
        field="attention",
        env="VSURGE_ATTENTION",
        kind="string",
        choices=("auto", "pallas", "jax"),
    ),
    EngineOption(
        key="maxNumBatchedTokens",
        field="max_num_batched_tokens",
        env="VSURGE_MAX_NUM_BATCHED_TOKENS",
        kind="integer",
        minimum=1,
    ),
    EngineOption(
        key="speculative",
        field="speculative",
        env="VSURGE_SPECULATIVE",
        kind="string",
        choices=("none", "ngram"),
        only="vdriver",
        idle=("none",),
        what="speculative decoding",
    ),
    EngineOption(
        key="numSpeculativeTokens",
        field="num_speculative_tokens",
        env="VSURGE_NUM_SPECULATIVE_TOKENS",
        kind="integer",
        minimum=1,
        maximum=16,
    ),
    EngineOption(
        key="kvCacheDtype",
        field="kv_cache_dtype",
        env="VSURGE_KV_CACHE_DTYPE",
        kind="string",
        choices=("auto", "bfloat16"),
        only="vdriver",
        idle=("auto",),
        what="dense cache",
    ),
    EngineOption(
        key="prefillDtype",
        field="prefill_dtype",
        env="VSURGE_PREFILL_DTYPE",
        kind="string",
        choices=("auto", "bfloat16"),
        only="vdriver",
        idle=("auto",),
        what="packed prefill",
    ),
    EngineOption(
        key="decodeDtype",
        field="decode_dtype",
        env="VSURGE_DECODE_DTYPE",
        kind="string",
        choices=("auto", "bfloat16"),
        only="vdriver",
        idle=("auto",),
        what="decode step",
    ),
    EngineOption(
        key="decodeSteps",
        field="decode_steps",
        env="VSURGE_DECODE_STEPS",
        kind="integer",
        minimum=1,
        only="vdriver",
        idle=(1,),
        what="decode blocks",
    ),
    EngineOption(
        key="quantization",
        field="quantization",
        env="VSURGE_QUANTIZATION",
        kind="string",
        choices=("none", "int8"),
    ),
    EngineOption(
        key="maxLoras",
        field="max_loras",
        env="VSURGE_MAX_LORAS",
        kind="integer",
        minimum=1,
        maximum=1024,
    ),
    EngineOption(
        key="maxLoraRank",
        field="max_lora_rank",
        env="VSURGE_MAX_LORA_RANK",
        kind="integer",
        minimum=1,
        maximum=1024,
    ),
    EngineOption(
        key="dtype",
        field="dtype",
        env="VSURGE_DTYPE",
        kind="string",
        choices=("float32", "bfloat16", "float16"),
    ),
)
# END GENERATED: engine-options

BY_KEY = {o.key: o for o in OPTIONS}
