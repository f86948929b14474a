"""Architecture families: `model_type` -> the model class, its partition rules and what its config differs in.

A new family is one module (its flax.nnx model) and one registration:

    register_architecture("myarch", MyArchForCausalLM, MY_RULES, hf_architecture="MyArchForCausalLM")

The model's shape is the engines' contract: ``model.model.embed_tokens`` (token ids to hidden states),
``model.model.layers`` (decoder layers of one structure, each ``layer(x, positions, backend, cache, meta,
lora)``), ``model.model.norm``, ``model(...)`` over the whole stack and ``compute_logits``; vEngine's
prefill runs the embedding, each layer and the norm as programs of their own (engines/dense/layered_prefill.py).

`architecture_for(model_type)` is the one lookup: `ModelConfig.from_hf` (config.json), the GGUF config and
tensor mapping (`general.architecture` through `gguf_architecture`), `build_model` (the class and the rules)
and `sharding.place_params` read it. An unknown `model_type` raises `CheckpointError` "unsupported
architecture", naming the supported ones. The built-in families (llama, mistral, qwen2, qwen3) register
themselves in `models/llama.py`, which the `vsurge.models` package imports: any import of this module runs
the package first, so the built-ins are registered before anyone outside the package can look one up
(the registry imports no family itself: the families import it, never the other way round).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError

__all__ = [
    "Architecture",
    "architecture_for",
    "architectures",
    "gguf_architectures",
    "register_architecture",
    "supported_architectures",
    "unregister_architecture",
]


@dataclass(frozen=True)
class Architecture:
    """One registered `model_type` and what the loaders need to know about it."""

    model_type: str
    model_cls: type  # called as model_cls(cfg: ModelConfig, *, dtype, rngs: nnx.Rngs)
    partition_rules: tuple[tuple[str, Any], ...]  # (regex on the parameter path, PartitionSpec), first match
    hf_architecture: str  # the config.json `architectures` class, e.g. "Qwen2ForCausalLM"
    gguf_architecture: str | None = None  # llama.cpp's `general.architecture` for this family, if it has one
    # What the config of this family differs in from plain Llama (read by ModelConfig.from_hf):
    qkv_bias: bool = False  # q/k/v projections always carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    o_bias: bool = True  # `attention_bias` also gives o_proj a bias (Llama, Qwen3; not Mistral, Qwen2)
    sliding_window_always: bool = False  # `sliding_window` is used as is (Mistral), not only with
    # `use_sliding_window` (Qwen configs carry a window they do not use)


_lock = threading.RLock()
_registry: dict[str, Architecture] = {}


def register_architecture(
    names: str | Iterable[str],
    model_cls: type,
    partition_rules: Sequence[tuple[str, Any]],
    *,
    hf_architecture: str | None = None,
    gguf_architecture: str | None = None,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    o_bias: bool = True,
    sliding_window_always: bool = False,
    replace: bool = False,
) -> tuple[Architecture, ...]:
    """Register `model_cls` (with its partition rules) for each `model_type` in `names`.

    hf_architecture: the config.json `architectures` class (default: the class name).
    gguf_architecture: the GGUF `general.architecture` read as this family (one name only).
    Registering a name again raises ValueError unless `replace`.
    """
    names = (names,) if isinstance(names, str) else tuple(names)
    if not names:
        raise ValueError("register_architecture needs at least one model_type")
    if gguf_architecture is not None and len(names) != 1:
        raise ValueError("gguf_architecture maps to one model_type; register the names one by one")
    rules = tuple(partition_rules)
    if not rules:
        raise ValueError("partition_rules is empty: give at least a catch-all (r'.*', PartitionSpec())")
    entries = tuple(
        Architecture(
            model_type=name,
            model_cls=model_cls,
            partition_rules=rules,
            hf_architecture=hf_architecture or model_cls.__name__,
            gguf_architecture=gguf_architecture,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            o_bias=o_bias,
            sliding_window_always=sliding_window_always,
        )
        for name in names
    )
    with _lock:
        for entry in entries:
            if not replace and entry.model_type in _registry:
                raise ValueError(f"architecture {entry.model_type!r} is already registered")
            if entry.gguf_architecture is not None:
                for other in _registry.values():
                    if other.gguf_architecture == entry.gguf_architecture and (
                        other.model_type != entry.model_type and not replace
                    ):
                        raise ValueError(
                            f"GGUF architecture {entry.gguf_architecture!r} is already read as "
                            f"{other.model_type!r}"
                        )
        for entry in entries:
            _registry[entry.model_type] = entry
    return entries


def unregister_architecture(names: str | Iterable[str]) -> None:
    """Remove registered families (tests register and remove their own)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    with _lock:
        for name in names:
            _registry.pop(name, None)


def architecture_for(
    model_type: Any, *, source: str | None = None, architectures: Any = None
) -> Architecture:
    """The registered family of `model_type`, or CheckpointError "unsupported architecture" naming the
    supported ones; `source` names the file and `architectures` (config.json's) is shown when given."""
    entry = _registry.get(model_type) if isinstance(model_type, str) else None
    if entry is not None:
        return entry
    shown = architectures or model_type
    where = f"{source}: " if source else ""
    raise CheckpointError(
        f"{where}unsupported architecture {shown!r} (model_type={model_type!r}); "
        f"supported: {', '.join(supported_architectures())}"
    )


def architectures() -> tuple[Architecture, ...]:
    """Every registered family, in registration order (the built-ins first)."""
    with _lock:
        return tuple(_registry.values())


def supported_architectures() -> tuple[str, ...]:
    """The registered `model_type` names, in registration order."""
    return tuple(a.model_type for a in architectures())


def gguf_architectures() -> dict[str, Architecture]:
    """GGUF `general.architecture` -> the family it is read as."""
    return {a.gguf_architecture: a for a in architectures() if a.gguf_architecture is not None}


class ModelTypes(Sequence[str]):
    """A live, read-only sequence of the registered `model_type` names (`SUPPORTED_ARCHITECTURES`)."""

    def __getitem__(self, index):
        return supported_architectures()[index]

    def __len__(self) -> int:
        return len(supported_architectures())

    def __iter__(self) -> Iterator[str]:
        return iter(supported_architectures())

    def __contains__(self, name: object) -> bool:
        return name in supported_architectures()

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(supported_architectures())


class PartitionRules(Mapping[str, tuple[tuple[str, Any], ...]]):
    """A live, read-only mapping model_type -> partition rules (`sharding.PARTITION_RULES`)."""

    def __getitem__(self, model_type: str):
        entry = _registry.get(model_type)
        if entry is None:
            raise KeyError(model_type)
        return entry.partition_rules

    def __iter__(self) -> Iterator[str]:
        return iter(supported_architectures())

    def __len__(self) -> int:
        return len(supported_architectures())

    def __repr__(self) -> str:
        return f"PartitionRules({list(self)})"


class GGUFArchitectures(Mapping[str, tuple[str, str]]):
    """A live, read-only mapping GGUF `general.architecture` -> (model_type, architectures class)
    (`gguf.SUPPORTED_ARCHITECTURES`)."""

    def __getitem__(self, arch: str) -> tuple[str, str]:
        entry = gguf_architectures()[arch]
        return entry.model_type, entry.hf_architecture

    def __iter__(self) -> Iterator[str]:
        return iter(gguf_architectures())

    def __len__(self) -> int:
        return len(gguf_architectures())

    def __repr__(self) -> str:
        return repr(dict(self))
