"""EngineConfig: every engine and driver knob, its default and its validation, in one place.

    from vsurge import EngineConfig
    cfg = EngineConfig(driver="odriver", max_concurrent_decodes=32, max_length=4096, page_size=64)
    surge = vSurge.create(model, tokenizer, cfg)                   # cfg.driver picks vdriver / odriver
    surge = vSurge.create_odriver(model, tokenizer, cfg, seed=7)   # keywords override the config

`vsurge serve` derives its engine options from the fields marked ``serve=True``: the flag is the field
name with dashes (``--max-concurrent-decodes``), the variable ``VSURGE_`` + the name in capitals
(``VSURGE_MAX_CONCURRENT_DECODES``); the help text and the text parser come from the field's metadata.
Adding a knob: one ``knob(...)`` field here (``serve=True`` to make it a serve option), then read
``config.<name>`` where it acts; ``python tools/gen_docs.py`` then gives InferenceModels ``spec.engine.<name>``.

``None`` given for a field whose default is not ``None`` means that default (``seed=None`` -> 894), so
callers may pass "unset" through. ``None`` where the default is ``None`` means "decided by the engine" (see
the help of each). This module imports no jax: the command line reads it for ``vsurge --help``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

from .env_options import parse_choice, parse_float, parse_int, parse_int_list
from .sampling_params import MAX_TOP_LOGPROBS

__all__ = [
    "DEFAULT_SEED",
    "ATTENTION_BACKENDS",
    "DRIVERS",
    "DriverOnly",
    "MAX_LENGTH_CAP",
    "QUANTIZATIONS",
    "SPECULATIVE_METHODS",
    "KV_CACHE_DTYPES",
    "PREFILL_DTYPES",
    "DECODE_DTYPES",
    "EngineConfig",
    "driver_default",
    "env_name",
    "flag_name",
    "serve_fields",
]

DEFAULT_SEED = 894  # the seed's engine seed, for requests without a seed of their own
DRIVERS = ("vdriver", "odriver")
ATTENTION_BACKENDS = ("auto", "pallas", "jax")  # paged attention (models/pallas_sharded.py)
# weight quantization at load (models/quantization.py)
QUANTIZATIONS = ("none", "int8")
# speculative decoding (engines/dense/speculative.py)
SPECULATIVE_METHODS = ("none", "ngram")
# vEngine's dense cache (models/attention.py: kv_store / kv_load)
KV_CACHE_DTYPES = ("auto", "bfloat16")
# vEngine's packed prefill (engines/dense/vengine.py: prefill_params)
PREFILL_DTYPES = ("auto", "bfloat16")
# vEngine's decode steps (engines/dense/vengine.py: step_params)
DECODE_DTYPES = ("auto", "bfloat16")
MAX_LENGTH_CAP = 2048  # max_length=None: the model's context, at most this

# Defaults that differ by driver, for fields left at None (the engine fills them in).
_PER_DRIVER: dict[str, dict[str, int]] = {
    "vdriver": {"max_concurrent_prefill": 64, "max_prefill_length": 1024},
    # odriver prefills one sequence's chunk per call; a longer prompt takes several chunks
    "odriver": {"max_concurrent_prefill": 1, "max_prefill_length": 512},
}


def driver_default(name: str, driver: str) -> int:
    """The default of knob ``name`` (left at None) on ``driver``."""
    return _PER_DRIVER[driver][name]


# ------------------------------------------------------------------------------------ value checks
# Each takes a value (of the field's type, given or parsed from text) and returns it normalized, or raises
# ValueError with the reason: the command line and EngineConfig say the same.


def _integer(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"expected an integer, got {v!r}")
    return int(v)


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"expected a number, got {v!r}")
    return float(v)


# A check's bounds are also attributes of it (minimum, maximum, exclusive_minimum): the InferenceModel CRD
# and the operator are generated from them (tools/docgen/engine_crd.py), so they say what the check does.


def at_least(low: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        v = _integer(v)
        if v < low:
            raise ValueError(f"must be >= {low}, got {v}")
        return v

    check.minimum = low  # type: ignore[attr-defined]
    return check


def _fraction(v: Any) -> float:
    v = _number(v)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"must be in (0, 1], got {v}")
    return v


_fraction.minimum, _fraction.exclusive_minimum, _fraction.maximum = 0, True, 1  # type: ignore[attr-defined]


def _lengths(v: Any) -> tuple[int, ...]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise ValueError(f"expected a list of integers, got {v!r}")
    out = tuple(sorted({at_least(1)(x) for x in v}))
    if not out:
        raise ValueError("expected at least one length")
    return out


_lengths.minimum = 1  # type: ignore[attr-defined]  # of each length


def _one_of(*choices: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {v!r}")
        return v

    return check


def _mesh(v: Any) -> Any:
    if isinstance(v, str) and not v.strip():
        raise ValueError("expected a mesh spec such as 'tp=4' or 'dp=2,tp=4'")
    return v  # a spec string (the engine makes the Mesh) or a jax Mesh


# ------------------------------------------------------------------------------------ fields


@dataclass(frozen=True)
class DriverOnly:
    """A knob that acts on one driver: any value but ``idle`` (and None) needs that driver. ``what`` names
    what it changes there; ``message`` is EngineConfig's refusal (the CRD's rule and the operator say
    "<key> applies to driver vdriver's <what>")."""

    idle: tuple[Any, ...]
    what: str
    message: str = "{value} is {only}'s {what}, not {driver}'s"
    driver: str = "vdriver"


def knob(
    default: Any,
    help: str,  # noqa: A002 - argparse's word
    *,
    check: Callable[[Any], Any] | None = None,
    serve: bool = False,
    text: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    shown: str | None = None,
    choices: Sequence[Any] | None = None,
    limits: tuple[int, int] | None = None,
    only: DriverOnly | None = None,
) -> Any:
    """A field of EngineConfig. ``check`` validates (and normalizes) a value; ``serve=True`` makes it a
    ``vsurge serve`` option, parsed from text by ``text`` and then checked; ``shown``: the default as the
    help prints it where the field's default is None; ``only``: the driver it needs.

    ``choices`` and ``limits`` (minimum, maximum; of each item for a list) narrow what an InferenceModel
    may ask for beyond ``check`` (the CRD and the operator enforce them): a deployment gets the sizes
    that are tuned and bounded, while tests and Python callers may build tiny engines."""
    meta = {"help": help, "check": check, "serve": serve, "text": text, "metavar": metavar, "shown": shown}
    meta.update(choices=None if choices is None else tuple(choices), limits=limits, only=only)
    return field(default=default, metadata=meta)


def choice_knob(
    default: str,
    help: str,  # noqa: A002 - argparse's word
    choices: Sequence[str],
    only: DriverOnly | None = None,
) -> Any:
    """A ``vsurge serve`` knob that takes one of ``choices``."""
    return knob(
        default,
        help,
        check=_one_of(*choices),
        serve=True,
        text=parse_choice(*choices),
        choices=choices,
        only=only,
    )


# Knobs that did nothing and were removed (issue 31): name -> why, and what to use. Giving one is an error
# that says so (EngineConfig(...), .replace, the engines' and vSurge.create_*'s keywords).
REMOVED_KNOBS = {
    "max_decode_stall": "removed: decode never waits for prompts being prefilled (issue 14), so there is "
    "no stall to bound; drop the option",
    "batch_size": "not an engine option: the decode batch is max_concurrent_decodes (the seed engines' "
    "positional batch_size argument sets it)",
}


@dataclass(frozen=True)
class EngineConfig:
    """How an engine and its driver are built. Frozen: derive variants with ``replace(**changes)``."""

    driver: str = choice_knob(
        "vdriver",
        "vdriver (one KV row per slot) or odriver (paged KV cache)",
        DRIVERS,
    )
    max_concurrent_decodes: int = knob(
        16,
        "decode slots (concurrent sequences)",
        check=at_least(1), serve=True, text=parse_int, metavar="N", limits=(1, 4096),
        shown="sized from the device's memory (vsurge/cli/sizing.py; 16 from Python)",
    )  # fmt: skip
    max_concurrent_prefill: int | None = knob(
        None,
        "prompts one prefill call may pack together (vdriver; 16 while streams decode)",
        check=at_least(1),
        serve=True,
        text=parse_int,
        metavar="N",
        shown="64 on vdriver, 1 on odriver",
    )
    max_length: int | None = knob(
        None,
        "context length: prompt + generated tokens",
        check=at_least(1),
        serve=True,
        text=parse_int,
        metavar="N",
        shown=f"the model's context, at most {MAX_LENGTH_CAP} (serve: less if memory is short)",
        limits=(16, 1048576),
    )
    prefill_lengths: tuple[int, ...] | None = knob(
        None,
        "prefill buckets, comma-separated (e.g. 128,256,512)",
        check=_lengths,
        serve=True,
        text=parse_int_list,
        metavar="N,N,...",
        shown="powers of two from 32 (from 128 on TPU), 1.5x steps between them from 128 on CPU",
        limits=(16, 1048576),
    )
    max_prefill_length: int | None = knob(
        None,
        "largest prefill bucket (default: the largest prefill length, else 1024 on vdriver, 512 on "
        "odriver); longer prompts are prefilled in chunks",
        check=at_least(1),
    )
    prefill_pack_tokens: int = knob(
        128,
        "vdriver: prompt tokens one prefill row packs (a longer prompt goes alone)",
        check=at_least(1),
    )
    prefill_pack_rows: int = knob(
        16,
        "vdriver: rows of prefill_pack_tokens one prefill call may hold when prompts queue up "
        "(4 while streams decode; 1: always one row)",
        check=at_least(1),
    )
    seed: int = knob(
        DEFAULT_SEED,
        "sampling seed for requests without one",
        check=_integer,
        serve=True,
        text=parse_int,
        metavar="N",
    )
    mesh: Any = knob(
        None,
        "device mesh, e.g. 'tp=4' or 'dp=2,tp=4' (in Python, also a jax Mesh)",
        check=_mesh,
        serve=True,
        text=str,
        metavar="SPEC",
        shown="one device",
    )
    num_top_logprobs: int = knob(
        MAX_TOP_LOGPROBS,
        "top logprobs the sampler computes per step (requests ask for up to this many)",
        check=at_least(0),
    )
    page_size: int = knob(
        128,
        "tokens per KV page (odriver)",
        check=at_least(1),
        serve=True,
        text=parse_int,
        metavar="N",
        choices=(8, 16, 32, 64, 128, 256, 512, 1024),
    )
    hbm_utilization: float = knob(
        0.6,
        "fraction of the device memory the weights leave that the KV cache may take: odriver's pages, and "
        "vsurge serve's default slots and context (vsurge/cli/sizing.py)",
        check=_fraction,
        serve=True,
        text=parse_float,
        metavar="F",
    )
    kv_cache_bytes: int | None = knob(
        None,
        "odriver: the KV pages' size in bytes, exactly (wins over hbm_utilization)",
        check=at_least(1),
    )
    min_decode_tokens: int = knob(
        128, "odriver: the smallest cache length a decode step reads", check=at_least(1)
    )
    enable_prefix_caching: bool = knob(True, "odriver: share the KV pages of common prompt prefixes")
    attention: str = choice_knob(
        "auto",
        "odriver's paged attention: pallas (the Pallas TPU ragged kernel in shard_map; interpreted off "
        "TPU), jax (pure JAX), auto (pallas on TPU when the kernel takes the model's shapes, else jax)",
        ATTENTION_BACKENDS,
    )
    max_queue_size: int = knob(
        1024, "requests waiting for prefill before QueueFullError (0: no limit)", check=at_least(0)
    )
    max_num_batched_tokens: int | None = knob(
        None,
        "tokens one device step runs: one per decoding sequence, the rest prefill chunks (odriver always; "
        "vdriver when set: prompts are then prefilled inside the decode steps instead of on the prefill "
        "thread)",
        check=at_least(1),
        serve=True,
        text=parse_int,
        metavar="N",
        shown="256, or 2 x max_concurrent_decodes if more",
    )
    speculative: str = choice_knob(
        "none",
        "speculative decoding: none, or ngram (prompt lookup: drafts copied from earlier in the prompt and "
        "output, verified in one batched step; greedy output unchanged; vdriver)",
        SPECULATIVE_METHODS,
        DriverOnly(("none",), "speculative decoding", "{value} decoding runs on driver {only}, not {driver}"),
    )
    num_speculative_tokens: int = knob(
        4,
        "draft tokens per sequence and step with --speculative ngram",
        check=at_least(1),
        serve=True,
        text=parse_int,
        metavar="K",
        limits=(1, 16),
    )
    kv_cache_dtype: str = choice_knob(
        "auto",
        "KV cache dtype: auto (the model's) or bfloat16 (half the bytes a decode step reads; stored as bits "
        "and widened to float32 for attention; vdriver)",
        KV_CACHE_DTYPES,
        DriverOnly(("auto",), "dense cache"),
    )
    prefill_dtype: str = choice_knob(
        "auto",
        "prefill's matmul dtype: auto (the model's) or bfloat16 (a bfloat16 copy of float32 kernels for "
        "prompt processing, float32 activations and accumulation: XLA:CPU's bf16 matmuls are ~1.7x faster; "
        "vdriver)",
        PREFILL_DTYPES,
        DriverOnly(("auto",), "packed prefill"),
    )
    decode_dtype: str = choice_knob(
        "auto",
        "decode's matmul dtype: auto (the model's) or bfloat16 (a bfloat16 copy of float32 matmul kernels "
        "for decode steps of 8 rows or more, float32 activations and accumulation; vdriver)",
        DECODE_DTYPES,
        DriverOnly(("auto",), "decode step"),
    )
    decode_steps: int | None = knob(
        None,
        "vdriver: decode steps one device program runs (a block): the host plans, dispatches and streams "
        "once per block of K tokens per sequence instead of once per token; steps that need the host "
        "between tokens (grammars, n-gram drafts, prompts written in place) stay single",
        check=at_least(1),
        serve=True,
        text=parse_int,
        metavar="K",
        shown="4 on TPU, 1 elsewhere",
        only=DriverOnly((1,), "decode blocks", "blocks of {value} are {only}'s, not {driver}'s"),
    )
    interleaved_mode: bool = knob(False, "vdriver: prefill only between decode steps")
    quantization: str = choice_knob(
        "none",
        "weights: none (the dtype's) or int8 (weight-only, per output channel, quantized at load; "
        "GGUF Q8_0 kept as stored)",
        QUANTIZATIONS,
    )
    detokenizing_blocks: int = knob(8, "decode steps that may run ahead of detokenization", check=at_least(1))
    # the LoRA adapter bank (models/lora.py): vsurge serve sets enable_lora with --lora or runtime updates
    enable_lora: bool = knob(False, "build the LoRA adapter bank (off: no bank, the programs of before)")
    max_loras: int = knob(
        8,
        "LoRA adapters on the device at once (the bank's slots); others load on demand, LRU evicted",
        check=at_least(1), serve=True, text=parse_int, metavar="N", limits=(1, 1024),
    )  # fmt: skip
    max_lora_rank: int = knob(
        64,
        "highest LoRA adapter rank the bank holds (a higher rank is refused)",
        check=at_least(1), serve=True, text=parse_int, metavar="R", limits=(1, 1024),
    )  # fmt: skip
    # Removed knobs, still accepted by name for one release only to say why they are gone (REMOVED_KNOBS):
    # not fields, so nothing lists, serves or renders them.
    max_decode_stall: InitVar[Any] = None
    batch_size: InitVar[Any] = None

    def __post_init__(self, max_decode_stall: Any = None, batch_size: Any = None) -> None:
        _refuse_removed({"max_decode_stall": max_decode_stall, "batch_size": batch_size})
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                if f.default is not None:  # None given: the default
                    object.__setattr__(self, f.name, f.default)
                continue
            check = f.metadata.get("check")
            if check is not None:
                try:
                    object.__setattr__(self, f.name, check(value))
                except ValueError as e:
                    raise ValueError(f"{f.name}: {e}") from None
        for f in _DRIVER_ONLY:
            only, value = f.metadata["only"], getattr(self, f.name)
            if value is not None and value not in only.idle and self.driver != only.driver:
                text = only.message.format(value=value, what=only.what, only=only.driver, driver=self.driver)
                raise ValueError(f"{f.name}: {text}")
        mpl, ml = self.max_prefill_length, self.max_length
        if mpl is not None and ml is not None and mpl > ml:
            raise ValueError(f"max_prefill_length {mpl} exceeds max_length {ml}")

    # ------------------------------------------------------------------ building
    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (and validated); an unknown name is a TypeError naming it."""
        _refuse_removed({k: v for k, v in changes.items() if k in REMOVED_KNOBS})
        unknown = sorted(set(changes) - _NAMES)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def build(cls, config: EngineConfig | None = None, **changes: Any) -> EngineConfig:
        """``config`` (default: every default) with the keyword arguments applied: what create_vdriver,
        create_odriver and the engines do with their ``(config, **kw)``."""
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(
                f"expected an EngineConfig, got {type(config).__name__}: pass engine options by keyword "
                "(max_concurrent_decodes=..., ...) or as EngineConfig(...)"
            )
        return (config or cls()).replace(**changes)

    def resolved(self, name: str) -> int:
        """Knob ``name``, or this driver's default for it where it is None."""
        value = getattr(self, name)
        return driver_default(name, self.driver) if value is None else value


_NAMES = frozenset(f.name for f in dataclasses.fields(EngineConfig))
_DRIVER_ONLY = tuple(f for f in dataclasses.fields(EngineConfig) if f.metadata.get("only"))


def _refuse_removed(values: dict[str, Any]) -> None:
    """A removed knob given (not None): a ValueError that says why it is gone and what to use instead."""
    for name, value in values.items():
        if value is not None:
            raise ValueError(f"{name}: {REMOVED_KNOBS[name]}")


def serve_fields() -> tuple[dataclasses.Field, ...]:
    """The fields `vsurge serve` reads from a flag or a VSURGE_* variable, in declaration order."""
    return tuple(f for f in dataclasses.fields(EngineConfig) if f.metadata.get("serve"))


def flag_name(f: dataclasses.Field | str) -> str:
    """``max_length`` -> ``--max-length``."""
    return "--" + (f if isinstance(f, str) else f.name).replace("_", "-")


def env_name(f: dataclasses.Field | str) -> str:
    """``max_length`` -> ``VSURGE_MAX_LENGTH``."""
    return "VSURGE_" + (f if isinstance(f, str) else f.name).upper()
