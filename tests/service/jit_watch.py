"""Catch XLA compilations: every shape must be compiled in compile(), none on a live request."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import jax
import numpy as np

from vsurge.seed_api.request import vSurgeRequest


class _Compiles(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Compiling" in record.getMessage():
            self.seen.append(record.getMessage()[:160])


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """Yields the list of programs compiled inside the block, by any thread (the setting is global:
    `jax.log_compiles()` would only cover the calling thread, not the driver's)."""
    handler, log = _Compiles(), logging.getLogger("jax")
    log.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler.seen
    finally:
        jax.config.update("jax_log_compiles", False)
        log.removeHandler(handler)


def live_mix(seed: int = 5) -> list[vSurgeRequest]:
    """Requests that reach every program: lone and packed prompts of each bucket, n > 1, seeded sampling
    with logprobs, top_k with penalties, logit_bias / allowed_token_ids, prompt logprobs, and a prompt
    longer than the largest bucket (chunked)."""
    rng = np.random.RandomState(seed)
    greedy = dict(temperature=0.0, ignore_eos=True, is_client_side_tokenization=True)
    reqs = [
        vSurgeRequest(prompt=list(rng.randint(3, 300, size=n)), max_tokens=5, **greedy)
        for n in (3, 9, 40, 60, 2, 17)
    ]
    sampled = dict(greedy, temperature=0.8, seed=3, n=2, logprobs=True, top_logprobs=3)
    reqs.append(vSurgeRequest(prompt=[5, 6, 7], max_tokens=6, **sampled))
    reqs.append(
        vSurgeRequest(
            prompt=[9, 8], max_tokens=4, top_k=5, repetition_penalty=1.3, presence_penalty=0.5, **greedy
        )
    )
    reqs.append(vSurgeRequest(prompt=[4, 5], max_tokens=3, logit_bias={7: 5.0}, **greedy))
    reqs.append(vSurgeRequest(prompt=[4, 6], max_tokens=3, allowed_token_ids=[8, 9], **sampled))
    reqs.append(
        vSurgeRequest(prompt=list(rng.randint(3, 300, size=11)), max_tokens=2, prompt_logprobs=2, **greedy)
    )
    reqs.append(vSurgeRequest(prompt=list(rng.randint(3, 300, size=100)), max_tokens=2, **greedy))
    return reqs


def compiled_while_serving(surge) -> list[str]:
    """Start a compiled vSurge, serve `live_mix()` to the end, stop it; returns what was compiled meanwhile,
    and each program a call reached with a signature start-up did not compile (run by its jit:
    engines/aot_program.py), as ``"run by jit: <name>"``."""
    from vsurge.engines.aot_program import missed, missed_since

    seen = missed()
    with compilations() as compiled:
        surge.start()
        try:
            actives = [surge.submit(r) for r in live_mix()]
            for a in actives:
                assert sum(len(x.token_ids) for items in a.channel for x in items) > 0
        finally:
            surge.stop()
    return compiled + [f"run by jit: {name}" for name in missed_since(seen)]
