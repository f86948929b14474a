"""The seed's positional arguments and defaults, told apart from values a caller gave. Pure, no jax.

The seed's constructors (`vEngine(model, processor, max_concurrent_decodes, ...)`, `create_odriver(model,
processor, storage, manager, page_size=128, ...)`, `vSurgeRequest(prompt, max_tokens, top_p=1.0, ...)`)
show their defaults in the signature, and here they also sit on top of a ``config`` (an EngineConfig) or a
``sampling`` (a SamplingParams) that the caller may pass as well. A default must then not override what
the config says, so each non-None default is a marked number (`default(894)`): equal to, and printed as,
the plain value (``inspect.signature`` shows ``seed=894``), but `is_default` tells it from a value the
caller passed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ENGINE_ARGS", "default", "given", "is_default", "seed_engine_config"]

# The engine options among the seed's engine constructor arguments (vEngine, oEngine).
ENGINE_ARGS = (
    "max_concurrent_decodes",
    "max_concurrent_prefill",
    "prefill_lengths",
    "max_prefill_length",
    "max_length",
    "batch_size",
    "seed",
)


class _DefaultInt(int):
    """An int default of a seed signature (see the module docstring)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


class _DefaultFloat(float):
    """A float default of a seed signature (see the module docstring)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return float.__repr__(self)


def default(value: int | float) -> int | float:
    """``value`` marked as a signature default (bool is not marked: it cannot be subclassed)."""
    if isinstance(value, bool):
        raise TypeError("a bool default cannot be marked; use None for 'not given'")
    return _DefaultInt(value) if isinstance(value, int) else _DefaultFloat(value)


def is_default(value: Any) -> bool:
    """True for None and for a marked default: the caller did not give this argument."""
    return value is None or type(value) in (_DefaultInt, _DefaultFloat)


def given(values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` the caller gave (defaults and None dropped)."""
    return {k: v for k, v in values.items() if not is_default(v)}


def seed_engine_config(
    config: Any,
    driver: str,
    seed_values: dict[str, Any],
    kw: dict[str, Any],
    *,
    third: Any = None,
) -> Any:
    """The EngineConfig of a seed-signature call: ``config`` (an EngineConfig or None) with the seed
    arguments the caller gave (``seed_values``, engine options only) and the keyword options ``kw``
    applied, for ``driver``.

    ``third``: the value in the third positional slot. An EngineConfig there (the signature before the
    seed's order was restored, `vEngine(model, tok, cfg)`) is taken as ``config``.
    """
    from ..contracts.engine_config import EngineConfig

    if isinstance(third, EngineConfig):
        if config is not None:
            raise TypeError("config given twice: positionally (third argument) and as config=")
        config = third
        seed_values = {k: v for k, v in seed_values.items() if v is not third}
    changes = given(seed_values)
    batch = changes.pop("batch_size", None)
    if batch is not None:  # the seed's batch size is the decode batch: it sets max_concurrent_decodes
        decodes = changes.get("max_concurrent_decodes", kw.get("max_concurrent_decodes"))
        if decodes is not None and decodes != batch:
            raise ValueError(
                f"batch_size {batch} and max_concurrent_decodes {decodes}: the seed's batch size is the "
                "decode batch; give one of them, or the same value"
            )
        changes["max_concurrent_decodes"] = batch
    lengths = changes.get("prefill_lengths")
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        changes["prefill_lengths"] = (lengths,)  # the seed types it `int | None`: one bucket
    return EngineConfig.build(config, **changes, **kw).replace(driver=driver)
