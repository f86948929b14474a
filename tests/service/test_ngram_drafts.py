"""The host side of n-gram speculation in vDriver (drivers/dense/ngram_drafts.py), which requests get drafts
(engines/dense/spec_verify.py: plain_sampling, from the SamplingParams fields' declarations) and the
verify-or-decode gate (engines/dense/speculative.py: expected_accepted, worth_verifying): pure code, tables."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vsurge.contracts.sampling_params import ANY_VALUE, DRAFTS, WHEN_OFF, SamplingParams
from vsurge.contracts.token_budget import TokenBudget
from vsurge.drivers.dense.ngram_drafts import P_RIGHT_WEIGHT, NgramDrafts
from vsurge.engines.dense.spec_verify import plain_sampling
from vsurge.engines.dense.speculative import expected_accepted, worth_verifying


def _budget(prompt: list[int], params: SamplingParams, max_length: int) -> TokenBudget:
    return TokenBudget(len(prompt), params.max_tokens, max_length)


GREEDY = SamplingParams(max_tokens=50, temperature=0.0)


@pytest.mark.parametrize(
    ("num_draft", "p", "expected"),
    [
        ([0, 1, 2], 0.5, 0.5 + (0.5 + 0.25)),
        ([4, 4], 1.0, 8.0),
        ([3], 0.0, 0.0),
        ([0, 0], 0.9, 0.0),
        ([3], 0.8, 0.8 + 0.64 + 0.512),
    ],
)
def test_expected_accepted(num_draft, p, expected):
    assert expected_accepted(np.array(num_draft), p) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("live", "num_draft", "p", "ratio", "verify"),
    [
        (4, [4, 4, 4, 4], 0.9, 2.0, True),  # ~3.1 accepted per row: far more than the one extra step costs
        (4, [4, 4, 4, 4], 0.3, 2.0, False),  # ~0.4 per row: a decode step emits more per second
        (32, [4] + [0] * 31, 0.9, 2.4, False),  # one row with a draft does not pay for 32 rows x 5 positions
        (1, [2], 0.6, 1.5, True),  # 0.96 accepted > 0.5 of a step
        (3, [0, 0, 0], 1.0, 1.0, False),  # nothing to verify
        (0, [], 0.5, 1.0, False),
        (2, [1, 1], 0.5, 1.0, True),  # before the cost is measured (ratio 1): any draft is verified
    ],
)
def test_worth_verifying(live, num_draft, p, ratio, verify):
    assert worth_verifying(live, np.array(num_draft, np.int32), p, ratio) is verify


def test_which_requests_speculate():
    assert plain_sampling(GREEDY) and plain_sampling(SamplingParams(temperature=0.8))
    for params in (
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(logprobs=True),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(min_tokens=3),
        SamplingParams(logit_bias={3: 1.0}),
    ):
        assert not plain_sampling(params), params


def test_an_option_declared_off_for_drafts_turns_them_off_when_set():
    later = dataclasses.make_dataclass(
        "Later",
        [
            ("strict", int, dataclasses.field(default=0, metadata={DRAFTS: WHEN_OFF})),
            ("tag", str, dataclasses.field(default="", metadata={DRAFTS: ANY_VALUE})),
            ("undeclared", int, 0),
        ],
        bases=(SamplingParams,),
    )
    assert plain_sampling(later(temperature=0.0))
    assert plain_sampling(later(temperature=0.0, tag="x"))  # any value of it allows drafts
    assert not plain_sampling(later(temperature=0.0, strict=2))  # set: no drafts
    assert not plain_sampling(later(temperature=0.0, undeclared=1))  # says nothing: set, no drafts either


def test_drafts_come_from_the_slots_own_tokens_and_respect_max_tokens_and_the_context():
    d = NgramDrafts(slots=3, k=4, max_length=40)
    d.start(
        0, [1, 2, 3, 4, 5, 6, 7, 1, 2], 3, GREEDY, _budget([1, 2, 3, 4, 5, 6, 7, 1, 2], GREEDY, 40)
    )  # ... 1 2 3: the n-gram "2 3" -> 4 5 6 7
    d.start(1, [9, 8, 7], 6, GREEDY, _budget([9, 8, 7], GREEDY, 40))  # nothing repeats
    d.start(
        2,
        [1, 2, 3, 4, 5, 1, 2],
        3,
        SamplingParams(max_tokens=3),
        _budget([1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=3), 40),
    )  # 2 more tokens to emit
    drafts, num = d.propose()
    assert num.tolist() == [4, 0, 1]
    assert drafts[0].tolist() == [4, 5, 6, 7] and drafts[2, :1].tolist() == [4]
    # a decode step: one token per live slot; a verify step: accepted + 1
    d.advance(np.array([4, 1, 4]))
    assert d.length.tolist() == [11, 5, 9]
    d.advance(np.array([[5, 6, 9, -1, -1], [2, -1, -1, -1, -1], [5, -1, -1, -1, -1]]), np.array([2, 0, 0]))
    assert d.tokens[0, :14].tolist() == [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 9]
    assert d.length.tolist() == [14, 6, 10]
    _, num = d.propose()
    assert num[2] == 0  # slot 2 reached prompt + max_tokens
    # the context caps a draft: 36 tokens held of 40, so a verify step may emit 4: 3 drafts + 1
    d.start(
        1, list(range(10, 43)) + [10, 11], 12, GREEDY, _budget(list(range(10, 43)) + [10, 11], GREEDY, 40)
    )  # "11 12" occurred: -> 13 14 15 (16 ...)
    drafts, num = d.propose()
    assert num[1] == 3 and drafts[1, :3].tolist() == [13, 14, 15]
    d.release(0)
    assert d.propose()[1][0] == 0


def test_ineligible_requests_never_get_drafts():
    d = NgramDrafts(slots=1, k=3, max_length=20)
    d.start(
        0, [1, 2, 1, 2, 1], 2, SamplingParams(top_k=3), _budget([1, 2, 1, 2, 1], SamplingParams(top_k=3), 20)
    )
    assert d.propose()[1].tolist() == [0]


def test_p_right_follows_how_often_the_first_draft_token_is_right():
    d = NgramDrafts(slots=2, k=2, max_length=20)
    draft = np.array([[5, 6], [7, 8]], np.int32)
    for _ in range(100):
        d.observe(draft, np.array([2, 2]), np.array([5, 7]))
    assert d.p_right > 0.99
    before = d.p_right
    d.observe(draft, np.array([2, 2]), np.array([5, 0]))  # half right
    assert d.p_right == pytest.approx(before + P_RIGHT_WEIGHT * (0.5 - before))
    d.observe(draft, np.array([0, 0]), np.array([0, 0]))  # no drafts: nothing learnt
    assert d.p_right == pytest.approx(before + P_RIGHT_WEIGHT * (0.5 - before))
