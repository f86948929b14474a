"""PEFT LoRA adapters for the tiny checkpoints (peft and torch: test-only), and the merged reference."""

from __future__ import annotations

import copy
import os

import torch

# (rank, alpha, target modules, rslora) of the adapters the LoRA tests serve: different ranks, targets and
# scalings, so a mix-up of slots, ranks or scaling shows in the logits
ADAPTERS = {
    "sql": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "chat": (4, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "legal": (16, 32, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"], True),
}


def make_adapter(
    base: torch.nn.Module, directory: str | os.PathLike, name: str, seed: int
) -> torch.nn.Module:
    """Save adapter ``name`` of ADAPTERS for ``base`` into ``directory``; returns the base with the
    adapter merged (a copy: ``base`` is unchanged). B is random: PEFT initialises it to zero, which would
    make every adapter the base model."""
    from peft import LoraConfig, get_peft_model

    rank, alpha, targets, rslora = ADAPTERS[name]
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():  # A keeps PEFT's init; B random, of the weights' size (tiny_models' 0.02 ~ W)
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.copy_(0.05 * torch.randn_like(p))
    peft_model.save_pretrained(directory)
    return peft_model.merge_and_unload().eval()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens of ``hf`` and the log-probability of each (the reference of a driver's logprobs)."""
    seq, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq])).logits[0, -1].double()
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            seq.append(tok)
    return seq[len(prompt) :], lps
