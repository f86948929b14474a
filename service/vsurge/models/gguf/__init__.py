"""Read GGUF checkpoints (llama.cpp's format) as Hugging Face configs and float32 numpy tensors.

`read_gguf(path)` parses the header, checks every tensor against the architecture and returns a
`GGUFCheckpoint`:

- `config`: a Hugging Face `config.json`-style dict (`model_type` llama, mistral, qwen2 or qwen3).
- `tensors`: a lazy, read-only mapping from Hugging Face parameter names to dequantized float32 arrays in
  Hugging Face shapes (Linear weights `[out_features, in_features]`). Each access dequantizes that one
  tensor from the memory-mapped file, so a loader can place tensors one by one without holding the
  model twice; nothing is cached.
- `tokenizer_source`: the GGUF path; `load_gguf_tokenizer(path)` builds the transformers tokenizer (with
  the chat template) from the file's `tokenizer.*` metadata, without torch (`tokenizer.py`).

`read_gguf_metadata(path, decode=keys)` reads the metadata alone, with the long string arrays named in
`decode` (the vocabulary, the merges) read whole.

llama.cpp's converter interleaves the rows of the q/k projections of the `llama` architecture (for its
rotary kernel); this module undoes it, so the weights are exactly the Hugging Face ones. Llama 3 rope
scaling, stored by llama.cpp as a `rope_freqs.weight` tensor of per-frequency divisors, is turned back
into the Hugging Face `rope_scaling` dict (and checked to reproduce that tensor).

Every problem with the file raises `CheckpointError` (a `ValueError`) naming the file and the problem.

The package by job: `reader` (the bounds-checked file format), `config` (metadata -> config dict), `tensors`
(tensor names, shapes, the q/k un-permutation, dequantization), `tokenizer` (the torch-free tokenizer) and
`checkpoint` (`read_gguf`, `GGUFCheckpoint`).
"""

from vsurge.models.errors import CheckpointError

from .checkpoint import GGUFCheckpoint, read_gguf
from .config import SUPPORTED_ARCHITECTURES
from .reader import StringArray, read_gguf_metadata
from .tensors import SUPPORTED_TENSOR_TYPES, GGUFTensorInfo, GGUFTensors
from .tokenizer import load_gguf_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "CheckpointError",
    "GGUFCheckpoint",
    "GGUFTensorInfo",
    "GGUFTensors",
    "StringArray",
    "load_gguf_tokenizer",
    "read_gguf",
    "read_gguf_metadata",
]
