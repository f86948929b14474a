"""The torch-free GGUF tokenizer (vsurge.models.gguf.tokenizer) against transformers' own GGUF tokenizer.

The reference is `AutoTokenizer.from_pretrained(dir, gguf_file=name)`, which imports torch (installed in the
test venv only). Checked on the default model's file (SmolLM2, byte-level BPE, pre-tokenizer "smollm") and on a
small sentencepiece-style ("llama") GGUF written here with gguf.GGUFWriter. Then: the service loads the default
model, builds its tokenizer and answers a generation request without importing torch.

One deliberate difference: transformers ignores `tokenizer.ggml.pre` "smollm" (it has no entry for it) and
splits digits like GPT-2, while llama.cpp, and SmolLM2's own tokenizer.json, first cut every digit out on its
own (`Digits(individual_digits=True)`). Only text with a whitespace run or a non-ASCII numeral next to a digit
tokenizes differently. For text with digits the reference is therefore transformers' tokenizer with
SmolLM2's own pre-tokenizer put back; for text without, transformers' tokenizer as it is.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest

from vsurge.models.default_model import default_model_path
from vsurge.models.errors import CheckpointError
from vsurge.models.gguf import load_gguf_tokenizer
from vsurge.models.gguf.tokenizer import gguf_backend_tokenizer

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "hello\nworld\n\nbye",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs\r\nCRLF\r\n",
    "       \n\n\n   \t  ",
    " ",
    "",
    "it's we'll THEY'RE I'd you've",
    "Déjà vu, naïve café, Straße, Ærøskøbing",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Привет, мир! Γειά σου κόσμε. שלום עולם. مرحبا بالعالم",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 ❤️",
    "math ∑∫√∞ ≈ π ≠ ℝ → ⊂",
    "def f(x):\n    return {'a': [x, x**2]}  # comment\n\n\nclass A(B):\n\tpass\n",
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "SELECT * FROM t WHERE a->>'b' = ?;",
    "~!@#$%^&*()_+`-=[]\\{}|;':\",./<>?",
    "zero\u200bwidth\u00a0nbsp\u3000ideographic",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>vsurge<file_sep>a.py<filename>x<|im_end|>",
    "text<|im_end|>text <|im_start|> spaced <|endoftext|>",
    "<|im_start|",
    "|im_end|>",
    "<|unknown_special|>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    # digits: these take the reference with SmolLM2's own pre-tokenizer
    "1234567890",
    "3.14159 1e-5 0x1F 1,000,000 -42",
    "a  1",
    "  1",
    "x =  12  +    345",
    "    1. first\n    2. second",
    "x 12345 ①② ² ٣ ½",
    "2024-12-01T20:10:37Z",
    "<|im_start|>1<|im_end|> 2",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Count to 3: "},
        {"role": "assistant", "content": "1, 2, 3"},
        {"role": "user", "content": "  Now in 日本語 😀\n\n"},
    ],
    [{"role": "user", "content": ""}],
]


def _has_digit(text: str) -> bool:
    return any(ch.isnumeric() for ch in text)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(smollm2):
    return load_gguf_tokenizer(smollm2)


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' own GGUF tokenizer for the file (its route imports torch)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


@pytest.fixture(scope="module")
def reference_smollm(reference):
    """The reference with SmolLM2's own pre-tokenizer (its tokenizer.json: each digit apart, then ByteLevel)."""
    from tokenizers import pre_tokenizers

    ref = copy.deepcopy(reference)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return ref


def test_smollm2_metadata_is_what_these_tests_assume(smollm2):
    from vsurge.models.gguf import read_gguf_metadata

    meta = read_gguf_metadata(smollm2, decode=("tokenizer.ggml.tokens",))
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


def test_encode_equals_transformers_without_digits(ours, reference):
    texts = [t for t in TEXTS if not _has_digit(t)]
    assert len(texts) > 20
    for text in texts:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert ours.tokenize(text) == reference.tokenize(text), text


def test_encode_equals_smollm2_pre_tokenizer_everywhere(ours, reference_smollm):
    for text in TEXTS:
        assert ours.encode(text) == reference_smollm.encode(text), text


def test_digits_split_as_llama_cpp_not_as_transformers(ours, reference):
    """The one deliberate difference, shown: transformers' GGUF route keeps "Ġ1" together with the space
    run before it; SmolLM2 (and llama.cpp for pre "smollm") cut the digit out first."""
    differing = [t for t in TEXTS if ours.encode(t) != reference.encode(t)]
    assert differing and all(_has_digit(t) for t in differing)
    two_spaces = reference.convert_tokens_to_ids("ĠĠ")
    assert ours.encode("a  1") == [
        reference.convert_tokens_to_ids("a"),
        two_spaces,
        ours.convert_tokens_to_ids("1"),
    ]


def test_decode_round_trips(ours, reference):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text, text
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    everything = list(range(len(reference)))
    assert ours.convert_ids_to_tokens(everything) == reference.convert_ids_to_tokens(everything)
    assert ours.decode(everything[:3000]) == reference.decode(everything[:3000])


def test_special_tokens_and_vocabulary(ours, reference):
    assert len(ours) == len(reference) == 49152
    assert ours.vocab_size == reference.vocab_size
    assert ours.get_vocab() == reference.get_vocab()
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(reference, name), name
        assert getattr(ours, f"{name}_id") == getattr(reference, f"{name}_id"), name
    assert ours.all_special_ids == reference.all_special_ids
    assert ours.all_special_tokens == reference.all_special_tokens
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()
    }
    assert ours.add_bos_token == reference.add_bos_token
    assert ours.chat_template == reference.chat_template and ours.chat_template
    assert ours.is_fast


def test_chat_template(ours, reference_smollm, reference):
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert text == reference.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            ids = ours.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, return_dict=False
            )
            assert ids == reference_smollm.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, return_dict=False
            )
            assert ours.decode(ids) == text


def test_backend_alone_matches(smollm2, ours):
    backend = gguf_backend_tokenizer(smollm2)
    for text in TEXTS:
        assert backend.encode(text).ids == ours.encode(text)


# --------------------------------------------------------------------------------------------------
# A sentencepiece-style ("llama") vocabulary in a GGUF written here


# Pieces of a sentencepiece BPE model, best first: each gets score -position, as such a model stores them.
_SPM_PIECES = "▁ e l o h w r d t a n s i he ll ▁h ▁w or ▁t hel ▁he ▁hel ▁hell ▁hello ▁wor ▁worl ▁world ▁the"
SPM_PIECES = [*_SPM_PIECES.split(" "), "▁th", "an", "in", "▁a", "▁an", "▁and", "▁▁", "▁▁▁▁"]
SPM_CHAT = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"


def write_spm_gguf(path: Path, *, add_bos: bool | None = True) -> Path:
    tokens = ["<unk>", "<s>", "</s>", "<|user|>"]
    types = [2, 3, 3, 4]  # unknown, control, control, user-defined
    scores = [0.0, 0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)  # byte
        scores.append(0.0)
    for position, piece in enumerate(SPM_PIECES):
        tokens.append(piece)
        types.append(1)
        scores.append(-1.0 - position)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    w.add_chat_template(SPM_CHAT)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPM_TEXTS = [
    "hello world",
    "hello  world and the hat",
    " leading",
    "    four spaces",
    "unknown: xyz Q!",
    "bytes é ñ 日本 😀",
    "<|user|> hello</s>world<s>",
    "",
    "the\nnew\tline",
]


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_sentencepiece_vocabulary_equals_transformers(tmp_path, add_bos):
    from transformers import AutoTokenizer

    path = write_spm_gguf(tmp_path / "spm.gguf", add_bos=add_bos)
    ours = load_gguf_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    # the merges recovered from the scores are applied: whole words come out as single pieces
    assert ours.tokenize("hello world") == ["▁hello", "▁world"]
    assert (ours.encode("hi")[0] == 1) == (add_bos is not False)  # llama.cpp adds BOS unless told not to
    assert ours.bos_token == ref.bos_token == "<s>" and ours.eos_token == ref.eos_token == "</s>"
    assert ours.unk_token == ref.unk_token == "<unk>"
    assert ours.get_vocab() == ref.get_vocab()
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages, tokenize=True, return_dict=False) == ref.apply_chat_template(
        messages, tokenize=True, return_dict=False
    )


# --------------------------------------------------------------------------------------------------
# Byte-level vocabularies with other `tokenizer.ggml.pre` splits, in GGUFs written here


def _byte_spelling() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


BPE_MERGES = [
    "1 2",
    "12 3",
    "Ġ 1",
    "Ġ Ġ",
    "h e",
    "Ġ t",
    "Ġt he",
    "l l",
    "ll o",
    "' s",
    "W O",
    "Ġ \n",
    "\n \n",
]
BPE_MERGES = [m.replace("\n", "Ċ") for m in BPE_MERGES]
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_TEXTS = [
    "12345 hello the  1 x's\n\n 9876543210",
    "  123",
    "Hello WORLD's 1234567 abc123def",
    "<|im_start|>user\n123<|im_end|>\n",
    "héllo 日本 😀 ①②",
    "a\n\n\nb   \n c",
]


def write_bpe_gguf(path: Path, pre: str) -> Path:
    spell = _byte_spelling()
    tokens = [spell[b] for b in range(256)] + [m.replace(" ", "") for m in BPE_MERGES] + BPE_SPECIALS
    types = [1] * (len(tokens) - len(BPE_SPECIALS)) + [3] * len(BPE_SPECIALS)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(BPE_MERGES)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", ["default", "gpt-2", "qwen2", "llama-bpe", "gpt-4o", "an-unknown-pre"])
def test_byte_level_pre_tokenizers_equal_transformers(tmp_path, pre):
    from transformers import AutoTokenizer

    path = write_bpe_gguf(tmp_path / "bpe.gguf", pre)
    ours = load_gguf_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in BPE_TEXTS:
        assert ours.encode(text) == ref.encode(text), (pre, text)
        assert ours.decode(ours.encode(text)) == text
    assert ours.get_vocab() == ref.get_vocab()


def test_byte_level_pre_tokenizers_differ_as_llama_cpp_does(tmp_path):
    """The splits really are applied: the same vocabulary cuts digits three ways."""
    cuts = {}
    for pre in ("default", "qwen2", "llama-bpe", "smollm"):
        tok = load_gguf_tokenizer(write_bpe_gguf(tmp_path / f"{pre}.gguf", pre))
        cuts[pre] = tok.tokenize(" 4123")
    assert cuts["default"] == ["Ġ", "4", "123"]  # " ?\p{N}+": one piece, merged by BPE
    assert cuts["qwen2"] == ["Ġ", "4", "1", "2", "3"]  # one digit at a time
    assert cuts["llama-bpe"] == ["Ġ", "4", "12", "3"]  # up to three digits: "412", "3"
    assert cuts["smollm"] == cuts["qwen2"]


def test_unsupported_tokenizer_model_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "[UNK]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"odd\.gguf.*'bert' is not supported"):
        load_gguf_tokenizer(path)


def test_missing_vocabulary_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"novocab\.gguf.*tokenizer\.ggml\.tokens"):
        load_gguf_tokenizer(path)
    with pytest.raises(CheckpointError, match="not found"):
        load_gguf_tokenizer(tmp_path / "missing.gguf")


# --------------------------------------------------------------------------------------------------
# The service never imports torch (torch IS installed here, so nothing hides an import)

_NO_TORCH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import httpx
    from vsurge.cli.main import build_surge, parse_serve_config
    from vsurge.models.compiled.compilation_cache import enable_compilation_cache
    from vsurge.server import vSurgeApiServer
    from vsurge.server.runner import start
    import vsurge

    cfg = parse_serve_config(["--model", "default", "--max-length", "128", "--prefill-lengths", "32,64",
                              "--max-concurrent-decodes", "2", "--port", "0"])
    api = vSurgeApiServer()

    def startup(api, say):
        enable_compilation_cache()  # as `vsurge serve` does: a rerun skips most of the compile
        model, processor = vsurge.load_model(cfg.model, dtype=cfg.dtype)
        api.add_model(cfg.model_name, build_surge(cfg, model, processor), load_seconds=0.0)

    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, startup=startup, progress=None)
    try:
        running.wait_ready(600)
        r = httpx.post(running.url + "/v1/chat/completions", timeout=300, json={
            "model": cfg.model_name, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        chat = r.json()
    finally:
        running.stop()
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "/torch/" in line or "libtorch" in line})
    print(json.dumps({
        "status": r.status_code,
        "content": chat["choices"][0]["message"]["content"],
        "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
        "torch_libs": libs,
    }))
    """
)


@pytest.mark.slow
def test_service_never_imports_torch(tmp_path):
    import importlib.util

    assert importlib.util.find_spec("torch") is not None  # else this test proves nothing
    env = dict(os.environ, JAX_PLATFORMS="cpu", VSURGE_CACHE_DIR=str(default_model_path().parent))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_SCRIPT],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == 200 and out["content"]
    assert out["torch_modules"] == [], "the service imported torch"
    assert out["torch_libs"] == []
