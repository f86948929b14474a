"""Which files of a remote listing a model needs: config, tokenizer files, chat template, the safetensors
weights and their index, or one named ``.gguf`` file; a PEFT LoRA adapter's config and weights. Nothing else
is downloaded."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ModelSourceError
from .store import RemoteFile

SMALL_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "model.safetensors.index.json",
    }
)


def select_files(source: str, files: Sequence[RemoteFile], prefix_is_file: bool = False) -> list[RemoteFile]:
    """The files to fetch, or a ModelSourceError saying what is missing. ``files`` are relative names."""
    if prefix_is_file:
        if len(files) == 1 and files[0].name.endswith(".gguf"):
            return list(files)
        raise ModelSourceError(source, "a single object must be a .gguf file", "invalid")
    top = {f.name: f for f in files if "/" not in f.name}
    if not files:
        raise ModelSourceError(source, "nothing found there (no objects under this prefix)", "not_found")
    if "adapter_config.json" in top:  # a PEFT LoRA adapter (models/peft_adapter.py)
        if "adapter_model.safetensors" not in top:
            raise ModelSourceError(source, "adapter_config.json but no adapter_model.safetensors", "invalid")
        return [top["adapter_config.json"], top["adapter_model.safetensors"]]
    weights = sorted(n for n in top if n.endswith(".safetensors"))
    ggufs = sorted(n for n in top if n.endswith(".gguf"))
    if "config.json" in top:
        if not weights:
            other = [n for n in top if n.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack"))]
            hint = f" (found {', '.join(sorted(other))}: only safetensors are read)" if other else ""
            raise ModelSourceError(source, f"config.json but no *.safetensors weights{hint}", "invalid")
        wanted = [n for n in top if n in SMALL_FILES] + weights
        return [top[n] for n in sorted(wanted)]
    if len(ggufs) == 1 and not weights:
        return [top[ggufs[0]]]
    if len(ggufs) > 1:
        names = ", ".join(ggufs[:8])
        raise ModelSourceError(source, f"several .gguf files ({names}); name one in the source", "invalid")
    listing = ", ".join(sorted(top)[:10]) or "only subdirectories"
    raise ModelSourceError(
        source, f"not a checkpoint: no config.json and no .gguf file (found {listing})", "invalid"
    )
