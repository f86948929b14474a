"""JAX models of the Llama family, their loaders and reference paths."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .errors import CheckpointError
from .llama import LlamaForCausalLM
from .loader import build_model, load_model
from .reference import greedy_by_recompute, greedy_generate, logits
from .registry import Architecture, architecture_for, register_architecture, supported_architectures

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Architecture",
    "CheckpointError",
    "LlamaForCausalLM",
    "ModelConfig",
    "architecture_for",
    "build_model",
    "greedy_by_recompute",
    "greedy_generate",
    "load_model",
    "logits",
    "register_architecture",
    "supported_architectures",
]
