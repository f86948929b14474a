"""PEFT LoRA adapters for the tiny checkpoints (peft and torch: test-only), the merged reference, and the
requests of the LoRA parity tests (test_lora.py, test_lora_paths.py)."""

from __future__ import annotations

import asyncio
import copy
import os

import torch


def bank_config(driver: str, **settings):
    """The engine every LoRA parity test serves ADAPTERS on: a bank of 3 slots (all resident at once) of
    rank 16, 4 decode slots, 64 positions, prefill buckets 16 and 32; ``settings`` add to it."""
    from vsurge.contracts.engine_config import EngineConfig

    return EngineConfig(
        driver=driver,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        max_concurrent_decodes=4,
        max_length=64,
        prefill_lengths=(16, 32),
        **settings,
    )


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


# The batch the parity tests serve: three adapters and the base, one per prompt, TOKENS greedy tokens each
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [200, 201, 202, 203, 204, 205], [64, 65]]
NAMES = [*ADAPTERS, None]
TOKENS = 12


def adapter_setup(tiny_checkpoint, tmp_path_factory) -> tuple[str, torch.nn.Module, dict]:
    """(model path, base torch model, {name: (adapter dir, merged torch model)}) of every adapter of
    ADAPTERS for the tiny Llama (8 heads, 4 kv heads)."""
    path, hf = tiny_checkpoint("llama", heads=8, kv_heads=4)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {n: (str(root / n), make_adapter(hf, root / n, n, seed=i)) for i, n in enumerate(ADAPTERS)}
    return path, hf, adapters


def reference(setup, prompts=PROMPTS, names=NAMES, tokens=TOKENS) -> list[tuple[list[int], list[float]]]:
    """Per prompt (its adapter names[i], None: the base): transformers' greedy tokens and their logprobs,
    with the adapter merged."""
    _, hf, adapters = setup
    return [hf_greedy(adapters[n][1] if n else hf, p, tokens) for p, n in zip(prompts, names, strict=True)]


def ids_request(ids, adapter=None, tokens=TOKENS, logprobs=True):
    from vsurge.seed_api.request import vSurgeRequest

    return vSurgeRequest(
        prompt=list(ids),
        max_tokens=tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=logprobs,
        is_client_side_tokenization=True,
        adapter=adapter,
    )


async def collect(surge, req) -> tuple[list[int], list[float]]:
    ids, lps = [], []
    async for items in surge.complete(req):
        for s in items:
            ids.extend(s.token_ids)
            lps.extend(t.logprob for t in s.logprobs or ())
    return ids, lps


async def run_all(surge, prompts, names, tokens=TOKENS, logprobs=True) -> list[tuple[list[int], list[float]]]:
    """Every prompt with its adapter, all at once (one batch): (tokens, logprobs) per prompt."""
    return await asyncio.gather(
        *(collect(surge, ids_request(p, n, tokens, logprobs)) for p, n in zip(prompts, names, strict=True))
    )
