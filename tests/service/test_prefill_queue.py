"""The prefill queue's order: shorter prompts first among those that arrived together, with ageing."""

from __future__ import annotations

import queue
import time

import pytest

from vsurge.contracts.sampling_params import SamplingParams
from vsurge.drivers.active_request import ActiveRequest
from vsurge.drivers.pipeline import PREFILL_MAX_DEFER_SECONDS, PREFILL_SECONDS_PER_TOKEN, PrefillQueue


def _req(n: int) -> ActiveRequest:
    return ActiveRequest(list(range(3, 3 + n)), SamplingParams(max_tokens=1))


def test_shorter_prompts_go_first_and_equal_ones_in_arrival_order():
    q = PrefillQueue(8)
    reqs = [_req(n) for n in (500, 10, 200, 10, 40)]
    for r in reqs:
        q.put_nowait(r)
    assert q.qsize() == 5
    got = [q.get_nowait() for _ in range(5)]
    assert got == [reqs[1], reqs[3], reqs[4], reqs[2], reqs[0]]
    with pytest.raises(queue.Empty):
        q.get_nowait()


def test_a_long_prompt_is_overtaken_only_by_prompts_that_arrived_soon_after_it():
    q = PrefillQueue(8)
    long = _req(100)
    q.put_nowait(long)
    soon = _req(1)
    q.put_nowait(soon)  # within 100 tokens' worth of seconds: it goes first
    time.sleep(100 * PREFILL_SECONDS_PER_TOKEN + 0.05)
    late = _req(1)
    q.put_nowait(late)  # later than that: the long prompt has waited long enough
    assert [q.get_nowait() for _ in range(3)] == [soon, long, late]


def test_the_queue_stays_bounded():
    q = PrefillQueue(2)
    q.put_nowait(_req(5))
    q.put_nowait(_req(1))
    with pytest.raises(queue.Full):
        q.put_nowait(_req(3))
    assert q.get(timeout=1).prompt_ids == [3]


def test_the_deferral_of_a_very_long_prompt_is_capped():
    # a prompt of 4x the tokens the cap stands for is deferred by the cap, not 4x it
    q = PrefillQueue(8)
    huge, tiny = _req(int(4 * PREFILL_MAX_DEFER_SECONDS / PREFILL_SECONDS_PER_TOKEN)), _req(1)
    q.put_nowait(huge)
    q.put_nowait(tiny)
    keys = {id(r): key for key, _, r in q.queue}
    gap = keys[id(huge)] - keys[id(tiny)]
    assert PREFILL_MAX_DEFER_SECONDS - 0.5 < gap <= PREFILL_MAX_DEFER_SECONDS
    assert [q.get_nowait() for _ in range(2)] == [tiny, huge]
