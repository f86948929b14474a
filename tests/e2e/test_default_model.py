"""The default model (SmolLM2-135M-Instruct GGUF) end to end: our greedy answer equals transformers'."""

import os
import time

import numpy as np
import pytest
import torch

import vsurge
from vsurge.models import greedy_generate, logits
from vsurge.models.default_model import default_model_path

pytestmark = pytest.mark.slow  # loads the real default model (make test-fast skips it)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default():
    t = time.perf_counter()
    model, tok = vsurge.load_model("default")
    print(f"default model loaded in {time.perf_counter() - t:.2f}s")
    return model, tok


@pytest.fixture(scope="module")
def hf_reference():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_chat_answer_matches_transformers_and_says_paris(default, hf_reference):
    model, tok = default
    prompt = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    eos = tok.eos_token_id
    ours = greedy_generate(model, [ids], 16, eos_token_ids=[eos])[0]
    with torch.no_grad():
        ref = hf_reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    theirs = ref[0, len(ids) :].tolist()
    theirs = theirs[: theirs.index(eos) + 1] if eos in theirs else theirs
    assert ours == theirs
    answer = tok.decode(ours, skip_special_tokens=True)
    assert "Paris" in answer, answer
    # past EOS too: all 16 greedy tokens by cached decode equal transformers' full-recompute argmax
    seq = list(ids)
    with torch.no_grad():
        for _ in range(16):
            seq.append(int(hf_reference(torch.tensor([seq])).logits[0, -1].argmax()))
    assert greedy_generate(model, [ids], 16)[0] == seq[len(ids) :]


def test_default_logits_match_transformers(default, hf_reference):
    model, _ = default
    ids = np.array([[1, 504, 3458, 282, 4649, 314, 7042, 30]])
    ours = logits(model, ids)
    with torch.no_grad():
        ref = hf_reference(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


def test_default_model_is_cached(default):
    path = default_model_path()
    assert path.exists() and path.suffix == ".gguf"
    cache = os.environ.get("VSURGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vsurge")
    assert str(path).startswith(str(cache))
