"""n-gram speculative decoding (vsurge.engines.dense.speculative): the prompt-lookup proposer, greedy exactness
of the verification against plain greedy decoding, and that rejection sampling keeps the target's
distribution (chi-square against the exact probabilities, fixed seeds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from vsurge.engines.dense.speculative import propose_ngram, propose_ngram_batch, verify_jit
from vsurge.engines.sampling import seed_key_data

# ------------------------------------------------------------------------------------------- proposer


def test_proposer_follows_the_most_recent_match_of_the_longest_suffix():
    #       0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # suffix (6, 7) occurs at 1 and 6; the most recent is 6 -> continuation 3, 4, 6
    assert propose_ngram(seq, 3, max_ngram=2).tolist() == [3, 4, 6]
    # the 3-gram (1, 6, 7)... is not the suffix; the suffix 3-gram (4, 6, 7) never occurred: falls to 2
    assert propose_ngram(seq, 3, max_ngram=3).tolist() == [3, 4, 6]
    # a longer match wins over a more recent shorter one
    seq = [1, 2, 3, 4, 9, 3, 5, 0, 2, 3]
    assert propose_ngram(seq, 2, max_ngram=2).tolist() == [4, 9]  # (2, 3) at 1, not (3,) at 5
    assert propose_ngram(seq, 2, max_ngram=1, min_ngram=1).tolist() == [5, 0]  # (3,) most recent at 5
    # the continuation is cut at the end of the sequence, and k bounds it
    assert propose_ngram([1, 2, 1], 5, min_ngram=1).tolist() == [2, 1]
    assert propose_ngram([1, 2, 1], 5).tolist() == []  # one-token matches only when asked for
    assert propose_ngram([1, 2, 3, 1, 2], 1).tolist() == [3]


def test_proposer_proposes_nothing_without_a_match():
    assert propose_ngram([1, 2, 3, 4], 4).tolist() == []
    assert propose_ngram([7], 4).tolist() == []
    assert propose_ngram([1, 2, 1, 2], 0).tolist() == []
    drafts, counts = propose_ngram_batch([[1, 2, 1], None, [1, 2, 3]], 3, min_ngram=1)
    assert counts.tolist() == [2, 0, 0]
    assert drafts.tolist() == [[2, 1, 0], [0, 0, 0], [0, 0, 0]]


# ----------------------------------------------------------------------------------------- a toy model

V = 6


def bigram_table(seed: int, scale: float = 1.5) -> np.ndarray:
    """A toy target model: the logits of the next token depend on the previous token only."""
    return np.random.default_rng(seed).normal(0.0, scale, (V, V)).astype(np.float32)


def scored(table: np.ndarray, last: np.ndarray, draft: np.ndarray) -> np.ndarray:
    """What a verify forward returns: logits after the last token, then after each draft token."""
    context = np.concatenate([last[:, None], draft], axis=1)  # [B, K+1]
    return table[context]


def keys(n: int, seed: int) -> np.ndarray:
    return np.stack([seed_key_data(seed, i) for i in range(n)])


# -------------------------------------------------------------------------------------------- greedy


def test_greedy_verify_emits_the_argmax_chain():
    rng = np.random.default_rng(0)
    b, k, v = 5, 4, 40
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    logits[0, 1, [3, 9]] = logits[0, 1].max() + 1.0  # a tie: the lower id wins, as in the sampler
    chain = logits.argmax(-1)
    draft = chain[:, :k].copy()
    draft[1, 2] = (draft[1, 2] + 1) % v  # row 1: rejected at 2
    draft[2, 0] = (draft[2, 0] + 1) % v  # row 2: rejected at once
    num = np.array([4, 4, 4, 2, 0], np.int32)  # row 3: two real draft tokens; row 4: none
    z = np.zeros(b, np.float32)
    out = verify_jit(
        jnp.asarray(logits), jnp.asarray(draft), jnp.asarray(num), z, keys(b, 1), np.zeros(b, np.int32)
    )
    acc = np.asarray(out.num_accepted)
    assert acc.tolist() == [4, 2, 0, 2, 0]
    tokens = np.asarray(out.tokens)
    for row in range(b):
        assert tokens[row, : acc[row] + 1].tolist() == chain[row, : acc[row] + 1].tolist()
        assert (tokens[row, acc[row] + 1 :] == -1).all()
    assert tokens[0, 1] == 3
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    want = np.take_along_axis(logits, chain[:, :, None], -1)[..., 0] - lse
    lp = np.asarray(out.logprob)
    for row in range(b):
        np.testing.assert_allclose(lp[row, : acc[row] + 1], want[row, : acc[row] + 1], rtol=1e-5, atol=1e-5)


def test_greedy_speculative_decoding_is_identical_to_plain_greedy():
    """Decode a repetitive toy model with n-gram drafts + verify: the tokens equal plain greedy decoding."""
    # a table whose greedy chain cycles, so prompt lookup finds matches and proposes long drafts, plus
    # noise so some drafts are wrong
    table = bigram_table(3, scale=0.3)
    for t in range(V):
        table[t, (t + 1) % V] += 3.0
    table[2, 5] += 5.0  # 2 -> 5 breaks the cycle: drafts learned from the prompt get rejected there
    prompt = [0, 1, 2, 3, 4, 5, 0, 1]
    n_out, k = 40, 4

    plain = list(prompt)
    for _ in range(n_out):
        plain.append(int(table[plain[-1]].argmax()))

    seq = list(prompt)
    steps = accepted_total = 0
    while len(seq) < len(prompt) + n_out:
        draft = np.zeros((1, k), np.int32)
        d = propose_ngram(seq, k)
        draft[0, : len(d)] = d
        logits = scored(table, np.array([seq[-1]]), draft)
        out = verify_jit(
            jnp.asarray(logits), draft, np.array([len(d)], np.int32), np.zeros(1, np.float32), keys(1, 0),
            np.array([len(seq) - len(prompt)], np.int32),
        )  # fmt: skip
        a = int(out.num_accepted[0])
        seq += np.asarray(out.tokens)[0, : a + 1].tolist()
        steps += 1
        accepted_total += a
    assert seq[: len(plain)] == plain
    assert steps < n_out / 2 and accepted_total > n_out / 2  # the drafts did pay off


# ---------------------------------------------------------------------------------------------- sampling


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return stats.chisquare(counts[keep], expected[keep]).pvalue


def softmax(x: np.ndarray, t: float) -> np.ndarray:
    z = np.asarray(x, np.float64) / t
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("draft_token", [0, 3])
def test_rejection_sampling_keeps_the_target_distribution(draft_token):
    """Two verify steps of many independent rows with a fixed, possibly bad, draft: the first two tokens
    are distributed as the target model's p(x | prev) p(y | x), and acceptance happens with p(draft)."""
    n, k, temp = 30000, 2, 0.8
    table = bigram_table(11)
    prev = 4
    rng_keys = keys(n, 7)
    out_tokens: list[list[int]] = [[] for _ in range(n)]
    last = np.full(n, prev, np.int32)
    first_acc = None
    step = np.zeros(n, np.int32)
    for _ in range(2):  # every row has >= 2 tokens after two verify steps
        draft = np.full((n, k), draft_token, np.int32)
        logits = scored(table, last, draft)
        out = verify_jit(
            jnp.asarray(logits), draft, np.full(n, k, np.int32), np.full(n, temp, np.float32), rng_keys, step
        )
        acc = np.asarray(out.num_accepted)
        tokens = np.asarray(out.tokens)
        if first_acc is None:
            first_acc = acc
        for row in range(n):
            out_tokens[row] += tokens[row, : acc[row] + 1].tolist()
        last = tokens[np.arange(n), acc]
        step = step + acc + 1
    p = softmax(table, temp)  # p[prev, next]
    joint = np.zeros((V, V))
    for toks in out_tokens:
        joint[toks[0], toks[1]] += 1
    expected = p[prev][:, None] * p  # p(x | prev) * p(y | x)
    assert chi_square_p(joint.ravel(), expected.ravel()) > 1e-3
    # the first position is accepted with probability p(draft | prev)
    rate = (first_acc >= 1).mean()
    se = np.sqrt(p[prev, draft_token] * (1 - p[prev, draft_token]) / n)
    assert abs(rate - p[prev, draft_token]) < 5 * se


def test_greedy_and_sampled_rows_share_a_batch():
    """A batch mixing greedy and sampled rows: greedy rows stay exact, sampled rows still differ by seed."""
    rng = np.random.default_rng(5)
    b, k, v = 4, 3, 30
    logits = jnp.asarray(rng.normal(size=(b, k + 1, v)).astype(np.float32))
    chain = np.asarray(logits).argmax(-1)
    draft = jnp.asarray(chain[:, :k])
    temp = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    num = np.full(b, k, np.int32)
    a = verify_jit(logits, draft, num, temp, keys(b, 1), np.zeros(b, np.int32))
    again = verify_jit(logits, draft, num, temp, keys(b, 1), np.zeros(b, np.int32))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(again.tokens))  # reproducible per key
    for row in (0, 2):
        assert int(a.num_accepted[row]) == k
        assert np.asarray(a.tokens)[row].tolist() == chain[row].tolist()
    # another key changes the sampled rows' draws somewhere across steps, never the greedy rows
    diff = False
    for s in range(1, 20):
        c = verify_jit(logits, draft, num, temp, keys(b, 100 + s), np.zeros(b, np.int32))
        assert np.asarray(c.tokens)[[0, 2]].tolist() == np.asarray(a.tokens)[[0, 2]].tolist()
        diff |= np.asarray(c.tokens)[[1, 3]].tolist() != np.asarray(a.tokens)[[1, 3]].tolist()
    assert diff
    assert jax.devices()[0].platform == "cpu"
