"""The tokenizer a GGUF file describes, built without torch from its `tokenizer.*` metadata.

transformers can build a tokenizer from a GGUF (`from_pretrained(..., gguf_file=...)`), but that path imports
torch, which the service does not install. This module builds the same `tokenizers.Tokenizer` from the
metadata llama.cpp's converter writes, and wraps it in transformers' `PreTrainedTokenizerFast` (with the chat
template), which needs no torch:

- `tokenizer.ggml.model` `"gpt2"`: byte-level BPE (SmolLM2, Llama 3, Qwen2/3, ...). The vocabulary is spelled
  in GPT-2's byte alphabet; a token that is not (a few converters store raw text) is respelled into it. Text
  is split before BPE by the regex llama.cpp uses for `tokenizer.ggml.pre` (`PRE_TOKENIZER_SPLITS`); an
  unknown or missing `pre` gets GPT-2's own split.
- `tokenizer.ggml.model` `"llama"`: sentencepiece-style BPE (Llama 2, Mistral, TinyLlama, ...): `▁` for a
  space, byte fallback through the `<0xXX>` tokens, the merges from the file or, when it has none (most
  files), recovered from the token scores, best score first.
- `tokenizer.ggml.token_type`: control tokens (3) become special added tokens, user-defined ones (4) plain
  added tokens, so both are matched whole in the text, as llama.cpp does.
- bos / eos / unk / pad from `tokenizer.ggml.*_token_id`; `add_bos_token` / `add_eos_token` from the file
  (for `"llama"` vocabularies llama.cpp adds BOS unless the file says otherwise); `chat_template` from
  `tokenizer.chat_template` (None for a base model).

Checked against transformers' own GGUF tokenizer (tests/service/test_gguf_tokenizer.py). Where the two differ
we follow llama.cpp and the model's own tokenizer.json: transformers has no split for pre "smollm" (SmolLM2)
and its relatives, which cut each digit off first; it does not set `ignore_merges` for Llama 3 vocabularies;
and it adds no BOS to a Llama 3 vocabulary whose file does not say.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from vsurge.models.errors import CheckpointError

__all__ = ["PRE_TOKENIZER_SPLITS", "gguf_backend_tokenizer", "load_gguf_tokenizer"]

# llama.cpp's token types (llama_token_type / gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, as llama.cpp splits text for each (llama-vocab.cpp). A list
# is applied in order, each regex splitting the pieces the previous ones left. "gpt2" is GPT-2's own split,
# which tokenizers' ByteLevel pre-tokenizer applies itself.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT = r"\p{N}"  # each digit on its own (StarCoder-style vocabularies: SmolLM, StarCoder, Refact, ...)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "olmo", "jais"), ("gpt2",)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), (_DIGIT, "gpt2")
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe", "lfm2"), (_LLAMA3,)
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo"), (_QWEN2,)),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O,)),
}
# llama.cpp: these vocabularies add BOS when the file does not say, and look a whole pre-token up in the
# vocabulary before merging (tokenizers' `ignore_merges`), as their tokenizer.json does.
_BOS_BY_DEFAULT = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3"))
_IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "lfm2", "llama4"))


def load_gguf_tokenizer(path: str | os.PathLike):
    """A transformers `PreTrainedTokenizerFast` with the chat template, from the GGUF's `tokenizer.*` metadata.

    No torch: the vocabulary is read with our GGUF reader and built with `tokenizers`. Raises `CheckpointError`
    (naming the file) for a missing file, missing tokenizer metadata or an unsupported tokenizer model.
    """
    PreTrainedTokenizerFast = _transformers_fast_tokenizer()
    path = Path(path)
    spec = _read_spec(path)
    try:
        backend = _build_backend(path, spec)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **_wrapper_kwargs(spec))
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot build a tokenizer from the GGUF metadata: {exc}") from exc
    tokenizer.name_or_path = str(path)
    return tokenizer


def gguf_backend_tokenizer(path: str | os.PathLike):
    """The bare `tokenizers.Tokenizer` (no transformers) the file describes."""
    path = Path(path)
    return _build_backend(path, _read_spec(path))


# --------------------------------------------------------------------------------------------------


def _transformers_fast_tokenizer():
    """transformers' PreTrainedTokenizerFast. Where torch is not installed (the service's own venv),
    importing transformers first prints "PyTorch was not found. Models won't be available ...": true and
    expected here (no transformers model is used), so that one advisory line is silenced while importing."""
    import sys

    if "transformers" not in sys.modules:
        before = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
        try:
            import transformers  # noqa: F401
        finally:
            if before is None:
                os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
            else:
                os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = before
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast


def _read_spec(path: Path) -> dict[str, Any]:
    from .reader import StringArray, read_gguf_metadata

    meta = read_gguf_metadata(path, decode=_ARRAYS)
    tokens = meta.get("tokenizer.ggml.tokens")
    model = meta.get("tokenizer.ggml.model")
    if model is None or tokens is None:
        raise CheckpointError(
            f"{path}: cannot build a tokenizer from the GGUF metadata: it has no "
            f"{'tokenizer.ggml.model' if model is None else 'tokenizer.ggml.tokens'}"
        )
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.ggml.tokens' is not a list of strings")
    n = len(tokens)

    def array(key: str, kind: type) -> list | None:
        value = meta.get(key)
        if value is None:
            return None
        if isinstance(value, StringArray | str | int | float):
            raise CheckpointError(f"{path}: GGUF metadata {key!r} is not an array")
        value = value.tolist() if hasattr(value, "tolist") else list(value)
        if len(value) != n:
            raise CheckpointError(f"{path}: GGUF metadata {key!r} has {len(value)} entries for {n} tokens")
        if not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
            raise CheckpointError(f"{path}: GGUF metadata {key!r} has entries that are not {kind.__name__}")
        return value

    def token_id(key: str) -> int | None:
        value = meta.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{path}: GGUF metadata {key!r} should be a token id, got {value!r}")
        if not 0 <= value < n:
            # llama.cpp writes -1 / out-of-range ids for "none" in some files; treat them as absent
            return None
        return value

    def flag(key: str) -> bool | None:
        value = meta.get(key)
        if value is None:
            return None
        if not isinstance(value, bool | int):
            raise CheckpointError(f"{path}: GGUF metadata {key!r} should be a boolean, got {value!r}")
        return bool(value)

    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and (
        not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges)
    ):
        raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.ggml.merges' is not a list of 'a b' pairs")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.chat_template' is not a string")
    scores = array("tokenizer.ggml.scores", float)
    return {
        "model": model,
        "pre": meta.get("tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_type": array("tokenizer.ggml.token_type", int),
        "scores": scores,
        "merges": merges,
        "bos": token_id("tokenizer.ggml.bos_token_id"),
        "eos": token_id("tokenizer.ggml.eos_token_id"),
        "unk": token_id("tokenizer.ggml.unknown_token_id"),
        "pad": token_id("tokenizer.ggml.padding_token_id"),
        "add_bos": flag("tokenizer.ggml.add_bos_token"),
        "add_eos": flag("tokenizer.ggml.add_eos_token"),
        "add_space_prefix": flag("tokenizer.ggml.add_space_prefix"),
        "chat_template": template,
    }


def _build_backend(path: Path, spec: dict[str, Any]):
    model = spec["model"]
    if model == "gpt2":
        tokenizer = _byte_level(spec)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(path, spec)
    else:
        raise CheckpointError(
            f"{path}: cannot build a tokenizer from the GGUF metadata: tokenizer.ggml.model {model!r} is not "
            "supported (supported: 'gpt2' byte-level BPE, 'llama' sentencepiece BPE)"
        )
    _add_special_tokens(tokenizer, spec)
    _set_post_processor(tokenizer, spec)
    return tokenizer


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character byte-level vocabularies spell it with."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level(spec: dict[str, Any]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_alphabet()
    alphabet = frozenset(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(spec["tokens"]):
        if not set(token) <= alphabet:  # raw text: respell its UTF-8 bytes in the byte alphabet
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index  # a duplicate token keeps its last id, as llama.cpp's token_to_id map does
    merges = _split_merges(spec["merges"] or [])
    pre = spec["pre"]
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in _IGNORE_MERGES,
    )
    tokenizer = Tokenizer(bpe)
    splits = PRE_TOKENIZER_SPLITS.get(pre, ("gpt2",))
    steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits if s != "gpt2"]
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=True, use_regex="gpt2" in splits
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    out = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        out.append((left, right))
    return out


def _sentencepiece_bpe(path: Path, spec: dict[str, Any]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = spec["tokens"]
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab[token] = index
    if spec["merges"] is not None:
        merges = _split_merges(spec["merges"])
    else:
        if spec["scores"] is None:
            raise CheckpointError(
                f"{path}: cannot build a tokenizer from the GGUF metadata: a 'llama' vocabulary needs "
                "tokenizer.ggml.merges or tokenizer.ggml.scores"
            )
        merges = _merges_from_scores(vocab, tokens, spec["scores"])
    unk = tokens[spec["unk"]] if spec["unk"] is not None else None
    bpe = models.BPE(
        vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = None
    add_space = spec["add_space_prefix"] if spec["add_space_prefix"] is not None else True
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(
    vocab: dict[str, int], tokens: list[str], scores: list[float]
) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: every way of cutting a token into two tokens of the
    vocabulary, best-scoring result first (ties: shorter left piece, then shorter right; then vocabulary
    order of the pieces), which is the order sentencepiece's BPE applies them in."""
    candidates = []
    for token, index in vocab.items():
        score = scores[index]
        pairs = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                pairs.append((vocab[left], vocab[right], left, right))
        pairs.sort()
        candidates.extend((score, left, right) for _, _, left, right in pairs)
    # stable sort: best score first, then shorter pieces first, else the order above
    candidates.sort(key=lambda c: (-c[0], len(c[1]), len(c[2])))
    return [(left, right) for _, left, right in candidates]


def _add_special_tokens(tokenizer, spec: dict[str, Any]) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens:
    llama.cpp matches both whole in the text instead of cutting them into pieces."""
    from tokenizers import AddedToken

    tokens, types = spec["tokens"], spec["token_type"] or []
    vocab = tokenizer.get_vocab()
    byte_level = spec["model"] == "gpt2"
    alphabet = frozenset(_byte_alphabet().values()) if byte_level else None

    def usable(token: str) -> bool:
        # In a byte-level vocabulary a token spelled outside the byte alphabet was respelled above, so its raw
        # text is not a token of the vocabulary; adding it would append a new id past the model's vocabulary.
        return token in vocab and (alphabet is None or set(token) <= alphabet)

    # bos/eos/unk/pad are not added here: the transformers wrapper makes them special tokens, as it does for
    # transformers' own GGUF route (a pad id pointing at an ordinary token then behaves the same in both).
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, t in zip(tokens, types, strict=False)
        if t == CONTROL and usable(token)
    ]
    if special:
        tokenizer.add_special_tokens(special)
    user = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i, t in enumerate(types)
        if t == USER_DEFINED and usable(tokens[i])
    ]
    if user:
        tokenizer.add_tokens(user)


def _add_flags(spec: dict[str, Any]) -> tuple[bool, bool]:
    add_bos = spec["add_bos"]
    if add_bos is None:
        add_bos = spec["model"] == "llama" or spec["pre"] in _BOS_BY_DEFAULT
    add_eos = bool(spec["add_eos"])
    return add_bos and spec["bos"] is not None, add_eos and spec["eos"] is not None


def _set_post_processor(tokenizer, spec: dict[str, Any]) -> None:
    from tokenizers import processors

    add_bos, add_eos = _add_flags(spec)
    tokens = spec["tokens"]
    bos = tokens[spec["bos"]] if add_bos else None
    eos = tokens[spec["eos"]] if add_eos else None
    single = " ".join(x for x in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if x)
    pair = " ".join(x for x in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
    specials = []
    if bos:
        specials.append((bos, spec["bos"]))
    if eos and eos != bos:
        specials.append((eos, spec["eos"]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def _wrapper_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    tokens = spec["tokens"]
    add_bos, add_eos = _add_flags(spec)
    kwargs: dict[str, Any] = {
        "chat_template": spec["chat_template"],
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for key in ("bos", "eos", "unk", "pad"):
        if spec[key] is not None:
            kwargs[f"{key}_token"] = tokens[spec[key]]
    return kwargs
