"""Tiny random checkpoints made with transformers, and a tiny tokenizer trained offline."""

from __future__ import annotations

import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! How are you today? I am fine, thank you.",
    "Serving large language models on TPU pods with JAX.",
    "日本語のテキスト、中文文本 and emoji 🙂🚀✨ mixed in.",
    "Numbers 0123456789 and punctuation: ;:,.!?()[]{}",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


ARCHS: dict[str, tuple[type, dict]] = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3": (
        transformers.LlamaConfig,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "tied": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
}
MODEL_CLASSES = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.MistralConfig: transformers.MistralForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
}


def make_checkpoint(
    directory: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 320,
    with_tokenizer: bool = True,
    **overrides,
):
    """Save a random `arch` model (and the tiny tokenizer) to `directory`; returns the torch model."""
    cfg_cls, extra = ARCHS[arch]
    tok = tiny_tokenizer() if with_tokenizer else None
    cfg = cfg_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=extra.get("tie_word_embeddings", False),
        eos_token_id=tok.eos_token_id if tok else None,
        pad_token_id=tok.pad_token_id if tok else None,
        bos_token_id=None,
        **{k: v for k, v in {**extra, **overrides}.items() if k != "tie_word_embeddings"},
    )
    torch.manual_seed(seed)
    model = MODEL_CLASSES[cfg_cls](cfg).eval()
    # random init leaves biases and norms at 0/1; perturb every tensor so each one matters for parity
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(directory)
    if tok is not None:
        tok.save_pretrained(directory)
    return model
