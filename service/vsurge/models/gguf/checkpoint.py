"""`read_gguf(path)`: the header, the config and the lazy tensors of one GGUF file, as a `GGUFCheckpoint`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vsurge.models.errors import CheckpointError

from .config import SUPPORTED_ARCHITECTURES, _build_config
from .reader import _Metadata, _parse
from .tensors import GGUFTensors, _map_tensors
from .tokenizer import load_gguf_tokenizer

__all__ = ["GGUFCheckpoint", "read_gguf"]


@dataclass
class GGUFCheckpoint:
    """A parsed GGUF checkpoint. `tensors` is lazy: see `GGUFTensors`."""

    path: Path
    config: dict[str, Any]
    tensors: GGUFTensors
    tokenizer_source: Path
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)  # scalar GGUF metadata

    def load_tokenizer(self):
        """The transformers tokenizer, with the chat template, built from this file's metadata."""
        return load_gguf_tokenizer(self.tokenizer_source)


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Parse a GGUF file into a Hugging Face-style config and a lazy mapping of float32 tensors.

    Only the header is read here (and the tensor table checked against the file size); tensor data stays
    in the memory-mapped file until accessed. Raises `CheckpointError` (naming the file) for a missing,
    truncated or corrupt file, an unsupported architecture, missing metadata, unsupported tensor types
    and tensors whose shape does not match the metadata.
    """
    path = Path(path)
    header = _parse(path)
    meta = _Metadata(path, header.metadata)

    arch = meta.get("general.architecture")
    if arch is None:
        raise CheckpointError(f"{path}: missing required GGUF metadata key 'general.architecture'")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    by_name = {t.name: t for t in header.tensors}
    config = _build_config(path, arch, meta, by_name)
    infos = _map_tensors(path, arch, config, header.tensors)
    return GGUFCheckpoint(
        path=path,
        config=config,
        tensors=GGUFTensors(path, by_name, infos),
        tokenizer_source=path,
        metadata=meta.scalars(),
    )
