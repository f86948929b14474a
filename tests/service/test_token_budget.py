"""One token budget (vsurge/contracts/token_budget.py): a sample produces exactly min(max_tokens, context left after
its prompt) tokens on both drivers, the step thread (which frees the slot) and the detokenize thread
(which ends the sample) read the same object, and no slot stays held. Off by one either way, these fail:
a token too many or too few, or a request that never ends because its slot was freed a step early."""

from __future__ import annotations

import time

import pytest

import vsurge
from vsurge import vSurge
from vsurge.contracts.token_budget import TokenBudget
from vsurge.seed_api.request import vSurgeRequest

MAX_LEN = 48
BUCKETS = [16, 32]


def test_the_budget_is_max_tokens_within_the_context():
    b = TokenBudget(prompt_len=5, max_tokens=7, max_length=MAX_LEN)
    assert (b.tokens, b.end) == (7, 12)
    assert [b.spent(n) for n in (5, 6, 7, 8)] == [False, False, True, True]
    c = TokenBudget(prompt_len=30, max_tokens=40, max_length=MAX_LEN)  # the context ends it first
    assert (c.tokens, c.end) == (18, MAX_LEN)
    assert not c.spent(17) and c.spent(18)
    assert TokenBudget(10, None, MAX_LEN).tokens == MAX_LEN - 10


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


@pytest.fixture(scope="module", params=["vdriver", "odriver"])
def surge(request, tiny):
    model, tok = tiny
    kw = dict(max_concurrent_decodes=2, prefill_lengths=BUCKETS, max_length=MAX_LEN)
    if request.param == "vdriver":
        s = vSurge.create_vdriver(model, tok, **kw)
    else:
        s = vSurge.create_odriver(model, tok, page_size=8, **kw)
    s.compile()
    s.start()
    yield s
    s.stop()


def _run(s: vSurge, prompt_len: int, max_tokens: int) -> tuple[list[int], str | None]:
    req = vSurgeRequest(
        prompt=[3 + i % 50 for i in range(prompt_len)],
        max_tokens=max_tokens,
        is_client_side_tokenization=True,
        temperature=0.0,
        ignore_eos=True,
    )
    active = s.submit(req)
    tokens, finish = [], None
    for items in active.channel:
        for sample in items:
            tokens += sample.token_ids
            finish = sample.finish_reason or finish
    return tokens, finish


@pytest.mark.parametrize(
    "prompt_len, max_tokens, expected",
    [
        (5, 1, 1),  # the first token, sampled at prefill, is the last
        (5, 2, 2),
        (5, 7, 7),  # max_tokens ends it
        (30, 40, MAX_LEN - 30),  # the context ends it first
        (MAX_LEN - 2, 5, 2),  # two tokens of context left
    ],
)
def test_a_sample_gets_exactly_its_budget(surge, prompt_len, max_tokens, expected):
    tokens, finish = _run(surge, prompt_len, max_tokens)
    assert (len(tokens), finish) == (expected, "length")
    deadline = time.time() + 10  # the step thread frees the slot no later than the detokenizer ends it
    while surge.driver.num_used_slots and time.time() < deadline:
        time.sleep(0.01)
    assert surge.driver.num_used_slots == 0
