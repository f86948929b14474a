"""Incremental detokenization and stop strings, on real tokenizers trained offline.

Three tokenizer families: byte-level BPE (GPT-2 / SmolLM2 style, tokens may hold part of a character),
byte-fallback BPE (Llama 2 style: ▁ for spaces, <0xAB> tokens, a Strip decoder) and byte-fallback Unigram
(SentencePiece style with a Metaspace decoder).
"""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vsurge.drivers.detokenize import (
    INITIAL_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
    make_decode_fn,
)

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog! Again and again.",
    "Emoji: 😀 😃 👍🏽 👨‍👩‍👧 ❤️ and more 😀😀 🎉",
    "中文：你好，世界。我们在测试分词器。",
    "日本語のテキストも少し。한국어도 조금.",
    "Café, naïve, résumé — déjà vu.",
    "Numbers 12345 and symbols #@$%^&*() {json: [1, 2]}",
] * 3

TEXTS = [
    "Hello world!",
    "Emoji 😀 then 👍🏽 and a family 👨‍👩‍👧 ok",
    "中文：你好，世界。",
    "mixed 日本語 and Café — naïve 🎉🎉 end",
    "  leading and   multiple spaces\nnew line\ttab",
    "😀",
    "你",
]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def byte_fallback_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=70)
    tok.train_from_iterator([c for c in CORPUS if c.isascii()], trainer)
    # Llama-style <0x00>..<0xFF> pieces are ordinary (non-special) tokens appended to the vocabulary.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    n = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = n + b
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def byte_fallback_unigram() -> PreTrainedTokenizerFast:
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    words = ["▁the", "▁Hello", "▁world", "▁is", "▁a", "▁and", "ing", "▁", "▁Café", "é", "▁end"]
    pieces += [(w, -2.0) for w in words]
    pieces += [(c, -5.0) for c in string.ascii_letters + string.digits + string.punctuation]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


TOKENIZERS = {
    "byte_level_bpe": byte_level_bpe,
    "byte_fallback_bpe": byte_fallback_bpe,
    "unigram": byte_fallback_unigram,
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request) -> PreTrainedTokenizerFast:
    return TOKENIZERS[request.param]()


@pytest.fixture(scope="module")
def bl_tok() -> PreTrainedTokenizerFast:
    return byte_level_bpe()


def ref_decode(tok, ids, skip=True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def byte_split_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte: the worst split a model can produce (every multibyte char held back)."""
    vocab = tok.get_vocab()
    if "<0x41>" in vocab:
        return [vocab[f"<0x{b:02X}>"] for b in text.encode()]
    # GPT-2's byte -> printable-character table, as the ByteLevel pre-tokenizer's alphabet uses it.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [vocab[table[b]] for b in text.encode()]


def stream(det: IncrementalDetokenizer, ids) -> list[str]:
    return [det.add(i) for i in ids] + [det.flush()]


# --------------------------------------------------------------------------------- incremental detokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_never_breaks_a_character(tok, text):
    for ids in (tok.encode(text, add_special_tokens=False), byte_split_ids(tok, text)):
        chunks = stream(IncrementalDetokenizer(tok), ids)
        assert "".join(chunks) == ref_decode(tok, ids)
        assert all("\ufffd" not in c for c in chunks), chunks


def test_multibyte_character_is_held_until_complete(tok):
    ids = byte_split_ids(tok, "a😀b你")
    det = IncrementalDetokenizer(tok)
    out = [det.add(i) for i in ids]
    # 'a' (1 byte), 😀 (4 bytes), 'b', 你 (3 bytes)
    assert out == ["a", "", "", "", "😀", "b", "", "", "你"]
    assert det.flush() == ""


def test_incomplete_tail_is_flushed_as_replacement(tok):
    ids = byte_split_ids(tok, "ok😀")[:-2]  # the emoji loses its last two bytes
    det = IncrementalDetokenizer(tok)
    assert "".join(det.add(i) for i in ids) == "ok"
    assert det.flush() == ref_decode(tok, ids)[2:]
    assert "\ufffd" in ref_decode(tok, ids)


def test_continuation_of_a_prompt(tok):
    for prompt_text, gen_text in (
        ("Hello world, this is", " a tiny 😀 test 你好"),
        ("中文：你好", "，世界。 ok"),
        ("The quick brown fox jumps over", " the lazy dog"),
    ):
        prompt = tok.encode(prompt_text, add_special_tokens=False)
        full = tok.encode(prompt_text + gen_text, add_special_tokens=False)
        if full[: len(prompt)] != prompt:  # tokenization merged across the boundary: not a continuation
            continue
        gen = full[len(prompt) :]
        det = IncrementalDetokenizer(tok, prompt_ids=prompt)
        got = "".join(stream(det, gen))
        whole, head = ref_decode(tok, full), ref_decode(tok, prompt)
        assert whole.startswith(head)
        assert got == whole[len(head) :]
        assert det.output_ids == gen


def test_special_tokens_skipped_or_kept(bl_tok):
    ids = bl_tok.encode("Hi 😀<|im_end|>you<|endoftext|>", add_special_tokens=False)
    special = bl_tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(special) <= set(ids)
    for skip in (True, False):
        got = "".join(stream(IncrementalDetokenizer(bl_tok, skip_special_tokens=skip), ids))
        assert got == ref_decode(bl_tok, ids, skip=skip)
    assert "<|im_end|>" not in "".join(stream(IncrementalDetokenizer(bl_tok), ids))


def whole_tokens(tok) -> list[int]:
    """Ids that decode alone to complete text (no byte pieces, no specials)."""
    special = set(tok.all_special_ids)
    return [
        i for i in range(len(tok)) if i not in special and "\ufffd" not in tok.decode([i]) and tok.decode([i])
    ]


@st.composite
def valid_streams(draw, tok, whole):
    """Random valid text as a model could emit it: whole tokens mixed with characters split into bytes."""
    ids: list[int] = []
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            ids.append(draw(st.sampled_from(whole)))
        else:
            ch = draw(st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\ufffd"))
            ids += byte_split_ids(tok, ch)
    return ids


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_valid_streams_equal_full_decode(tok, data):
    whole = whole_tokens(tok)
    ids = data.draw(valid_streams(tok, whole))
    prompt = data.draw(st.one_of(st.none(), valid_streams(tok, whole)))
    det = IncrementalDetokenizer(tok, prompt_ids=prompt, max_held_tokens=data.draw(st.sampled_from([4, 16])))
    chunks = stream(det, ids)
    assert all("\ufffd" not in c for c in chunks)
    whole_text, head = ref_decode(tok, (prompt or []) + ids), ref_decode(tok, prompt or [])
    assert whole_text.startswith(head)
    assert "".join(chunks) == whole_text[len(head) :]


def test_a_byte_encoded_metaspace_after_a_window_start_stays_a_space():
    """Found by the property test above: ▁the <0x30> <0x30> then "▁" (U+2581) as three byte pieces. The
    byte run "00▁" fuses into one piece; a window starting on the second <0x30> made it the window's first
    piece, whose "▁" SentencePiece's decoder drops, while the full decode keeps it as a space."""
    tok = byte_fallback_unigram()
    vocab = tok.get_vocab()
    ids = [vocab["▁the"]] + [vocab[f"<0x{b:02X}>"] for b in "00▁".encode()]
    assert ref_decode(tok, ids) == "the00 "
    for prompt in (None, ids[:2]):
        gen = ids if prompt is None else ids[2:]
        assert (
            "".join(stream(IncrementalDetokenizer(tok, prompt_ids=prompt), gen))
            == ref_decode(tok, (prompt or []) + gen)[len(ref_decode(tok, prompt or [])) :]
        )


def test_a_byte_encoded_metaspace_in_the_text_s_first_piece_is_dropped_as_the_full_decode_drops_it():
    """Found by the property test above: <0x30> <0x30> then "▁" as three byte pieces open the text. They
    fuse into the text's first piece, whose every "▁" the Metaspace decoder drops ("00", no space); a
    window starting on the second <0x30> with the anchor in front kept the "▁" as a space ("00 ")."""
    tok = byte_fallback_unigram()
    vocab = tok.get_vocab()
    ids = [vocab[f"<0x{b:02X}>"] for b in "00▁".encode()]
    assert ref_decode(tok, ids) == "00"
    for held in (4, 16):
        assert "".join(stream(IncrementalDetokenizer(tok, max_held_tokens=held), ids)) == "00"
    # past the opening run the anchor applies again: a later "▁" in a run is a space, as in the full text
    tail = [vocab["▁the"], *ids]
    assert "".join(stream(IncrementalDetokenizer(tok), ids + tail)) == ref_decode(tok, ids + tail)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_byte_level_ids_equal_full_decode(bl_tok, data):
    """Arbitrary byte-level ids, invalid UTF-8 included: the stream ends equal to the full decode.

    (Byte-level decoding is lossy per invalid sequence, so released text never changes afterwards. A
    byte-fallback decoder instead turns a whole run of <0xAB> tokens into U+FFFDs once any byte in it is
    invalid, retroactively; there the stream keeps the characters it already sent.)
    """
    n_vocab = len(bl_tok)
    ids = data.draw(st.lists(st.integers(0, n_vocab - 1), max_size=40))
    prompt = data.draw(st.one_of(st.none(), st.lists(st.integers(0, n_vocab - 1), max_size=8)))
    det = IncrementalDetokenizer(
        bl_tok, prompt_ids=prompt, max_held_tokens=data.draw(st.sampled_from([2, 16]))
    )
    got = "".join(stream(det, ids))
    if not prompt:
        assert got == ref_decode(bl_tok, ids)
    else:
        whole, head = ref_decode(bl_tok, prompt + ids), ref_decode(bl_tok, prompt)
        if whole.startswith(head) and not head.endswith("\ufffd"):
            assert got == whole[len(head) :]


def test_garbage_bytes_do_not_stall_the_stream(bl_tok):
    # 40 lead bytes of 4-byte sequences: the decoded tail always ends in U+FFFD.
    ids = [byte_split_ids(bl_tok, "😀")[0]] * 40
    det = IncrementalDetokenizer(bl_tok, max_held_tokens=4)
    outs = [det.add(i) for i in ids]
    assert sum(1 for o in outs if o) > 10  # released progressively, not all at the end
    assert "".join(outs) + det.flush() == ref_decode(bl_tok, ids)


class CountingTokenizer:
    """A slow-path tokenizer (no Rust backend exposed) that records the window sizes it decodes."""

    def __init__(self, inner):
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        self.sizes.append(len(ids))
        return self.inner.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )


def test_decodes_only_a_small_window(tok):
    text = " ".join(TEXTS) * 6
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 300
    counting = CountingTokenizer(tok)
    # A prompt that ends on a character boundary, so its text is a prefix of the whole text.
    cut = next(k for k in range(50, 80) if ref_decode(tok, ids).startswith(ref_decode(tok, ids[:k])))
    prompt = ids[:cut]
    det = IncrementalDetokenizer(counting, prompt_ids=prompt)
    got = "".join(stream(det, ids[cut:]))
    assert got == ref_decode(tok, ids)[len(ref_decode(tok, prompt)) :]
    # Windows span the held tokens of one character plus the previous emission: a handful, never O(n).
    assert max(counting.sizes) <= 2 * 4 + INITIAL_CONTEXT_TOKENS
    assert sum(counting.sizes) <= 10 * len(ids)


def test_make_decode_fn_uses_backend_and_matches_wrapper(tok):
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    fast = make_decode_fn(tok)
    assert fast(ids) == ref_decode(tok, ids)
    assert make_decode_fn(tok.backend_tokenizer)(ids) == ref_decode(tok, ids)
    assert make_decode_fn(CountingTokenizer(tok))(ids) == ref_decode(tok, ids)


# ----------------------------------------------------------------------------------------------- stop strings


def run_matcher(stops, chunks):
    m = StopStringMatcher(stops)
    out, hit = [], False
    for c in chunks:
        text, hit = m.feed(c)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), m.hit


def reference_cut(stops, text):
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    at = min(i for i, _ in found)
    return text[:at], at


def test_stop_string_cut_across_chunks():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello ST") == ("hello ", False)
    assert m.held == "ST"
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.hit == "STOP"
    assert m.feed("anything") == ("", True)
    assert m.flush() == ""


def test_false_start_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"
    assert m.hit is None


def test_earliest_stop_wins_even_if_a_later_one_completes_first():
    # "b" completes at "ab" but "abc" started earlier: wait for it to decide.
    assert run_matcher(["abc", "b"], ["a", "b", "c", "d"]) == ("", "abc")
    assert run_matcher(["abc", "b"], ["a", "b", "x"]) == ("a", "b")
    # The text ends while "abc" is still undecided: flush cuts at the complete "b".
    assert run_matcher(["abc", "b"], ["xa", "b"]) == ("xa", "b")
    assert run_matcher(["ab", "abc"], ["ab"]) == ("", "ab")


def test_unicode_stops_and_no_stops():
    assert run_matcher(["😀", "。"], ["你好", "，世界", "。再见"]) == ("你好，世界", "。")
    assert run_matcher(["\n\n"], ["line\n", "\nnext"]) == ("line", "\n\n")
    assert run_matcher([], ["any", "thing"]) == ("anything", None)
    assert run_matcher(None, ["x"]) == ("x", None)
    with pytest.raises(ValueError):
        StopStringMatcher([""])


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=4),
    text=st.text(alphabet="abcd", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_streaming_equals_whole_text(stops, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    want, at = reference_cut(stops, text)
    got, hit = run_matcher(stops, chunks)
    assert got == want
    assert (hit is not None) == (at is not None)
    if hit is not None:
        assert text[at : at + len(hit)] == hit
