"""GGUF checkpoints (llama.cpp's format) as Hugging Face configs and float32 numpy tensors."""

from .reader import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_TENSOR_TYPES,
    CheckpointError,
    GGUFCheckpoint,
    GGUFTensorInfo,
    GGUFTensors,
    StringArray,
    load_gguf_tokenizer,
    read_gguf,
    read_gguf_metadata,
)

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
