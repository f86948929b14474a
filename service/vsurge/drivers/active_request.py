"""One request's life inside a driver: its samples' progress and the channel its results flow back on."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..contracts.request import RequestFailedError, ReturnSample, TokenLogprob, vSurgeMetadata
from ..contracts.sampling_params import SamplingParams
from ..contracts.token_budget import TokenBudget
from .detokenize import IncrementalDetokenizer, StopStringMatcher

_END = object()


class ReturnChannel:
    """Thread-safe hand-off from driver threads to one consumer, async (bound to a loop) or blocking."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def _send(self, item: Any) -> None:
        if self._loop is None:
            self._q.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's loop is gone: nobody is listening any more

    def put(self, samples: list[ReturnSample]) -> None:
        self._send(samples)

    def close(self, error: BaseException | None = None) -> None:
        self._send(error if error is not None else _END)

    def _unwrap(self, item: Any):
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[list[ReturnSample]]:
        while (item := self._unwrap(self._q.get())) is not None:
            yield item

    async def __aiter__(self) -> AsyncIterator[list[ReturnSample]]:
        while (item := self._unwrap(await self._aq.get())) is not None:
            yield item


@dataclass
class SampleProgress:
    """Host-side state of one of a request's n samples."""

    index: int
    detok: IncrementalDetokenizer | None
    matcher: StopStringMatcher | None
    token_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    first_token_at: float | None = None
    # what has not been handed to the consumer yet
    text_delta: str = ""
    ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprob] = field(default_factory=list)
    dirty: bool = False
    prompt_info_sent: bool = False  # the prompt's ids / logprobs / cached count go with the first delta

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class ActiveRequest:
    """A request as the driver sees it. Drivers accept nothing else (`submit_request` raises TypeError).

    Its state is declared here and nowhere else (``__slots__``): a driver setting an attribute this class
    does not declare fails at once instead of growing the request behind its back."""

    __slots__ = (
        "id",
        "adapter",
        "adapter_slot",
        "prompt_ids",
        "params",
        "model",
        "metadata",
        "channel",
        "stop_ids",
        "keys",
        "samples",
        "_cancelled",
        "_lock",
        "error",
        "prompt_logprobs",
        "num_cached_tokens",
        "in_pipeline",
        "finalized",
        "_budget",
    )

    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        processor: Any = None,
        detokenize: bool = True,
        eos_token_ids: Sequence[int] = (),
        metadata: vSurgeMetadata | None = None,
        channel: ReturnChannel | None = None,
        model: str = "",
        adapter: str | None = None,
    ):
        from ..engines.sampling import seed_key_data

        self.id = (metadata.id if metadata and metadata.id else None) or uuid.uuid4().hex
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.model = model
        self.adapter = adapter  # the LoRA adapter's name (None: the base model)
        self.adapter_slot = -1  # its bank slot once the driver pinned one (drivers/lora_adapters.py)
        self.metadata = metadata or vSurgeMetadata(id=self.id)
        self.channel = channel or ReturnChannel()
        self.stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_ids.update(eos_token_ids)
        self.keys = [seed_key_data(params.seed, i) for i in range(params.n)]
        self.samples = [
            SampleProgress(
                index=i,
                detok=IncrementalDetokenizer(processor, prompt_ids)
                if detokenize and processor is not None
                else None,
                matcher=StopStringMatcher(params.stop) if params.stop and detokenize else None,
            )
            for i in range(params.n)
        ]
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self.error: str | None = None
        # set by the driver before the first token: prompt logprobs (params.prompt_logprobs) and how many
        # prompt tokens the prefix cache supplied
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.num_cached_tokens = 0
        # the driver's bookkeeping (under its locks): still before a decode lane, and ended exactly once
        self.in_pipeline = False
        self.finalized = False
        self._budget: TokenBudget | None = None

    # ------------------------------------------------------------------ consumer side
    def cancel(self) -> None:
        """Stop generating: the driver frees this request's slots on its next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    # ------------------------------------------------------------------ driver side
    def budget(self, max_length: int) -> TokenBudget:
        """Each sample's token budget under an engine of ``max_length`` (token_budget.py), made once: the
        step thread and the detokenize thread read this same object."""
        b = self._budget
        if b is None or b.max_length != max_length:
            b = self._budget = TokenBudget(len(self.prompt_ids), self.params.max_tokens, max_length)
        return b

    def add_token(
        self,
        index: int,
        token: int,
        logprob: float,
        top_ids: np.ndarray,
        top_lps: np.ndarray,
        max_length: int,
    ) -> str | None:
        """Account one generated token of sample `index`; returns its finish reason once it finishes."""
        s = self.samples[index]
        if s.done:
            return None
        now = time.time()
        if s.first_token_at is None:
            s.first_token_at = now
            if self.metadata.first_token_at is None:
                self.metadata.first_token_at = now
        s.token_ids.append(token)
        s.ids_delta.append(token)
        s.dirty = True
        p = self.params
        if p.logprobs:
            k = p.top_logprobs
            top = [(int(i), float(lp)) for i, lp in zip(top_ids[:k], top_lps[:k], strict=True)]
            s.logprobs_delta.append(TokenLogprob(token, float(logprob), top))
        n = len(s.token_ids)
        finish = None
        if token in self.stop_ids and n > p.min_tokens:
            finish = "stop"  # the stop token's text is not part of the output
        else:
            if s.detok is not None:
                text = s.detok.add(token)
                if s.matcher is not None:
                    text, hit = s.matcher.feed(text)
                    if hit:
                        finish = "stop"
                s.text_delta += text
            if finish is None and self.budget(max_length).spent(n):
                finish = "length"
        if finish is not None:
            if finish != "stop":
                # the end of the output: release text held back for an unfinished character or a
                # possible stop-string prefix
                tail = s.detok.flush() if s.detok is not None else ""
                if s.matcher is not None:
                    tail, _ = s.matcher.feed(tail)
                    tail += s.matcher.flush()
                s.text_delta += tail
            s.finish_reason = finish
        return finish

    def finish_all(self, reason: str) -> None:
        for s in self.samples:
            if not s.done:
                s.finish_reason = reason
                s.dirty = True

    def take_deltas(self) -> list[ReturnSample]:
        """Everything new since the last call, as one ReturnSample per sample that advanced."""
        out = []
        now = time.time()
        for s in self.samples:
            if not s.dirty:
                continue
            n = len(s.token_ids)
            elapsed = now - s.first_token_at if s.first_token_at else 0.0
            out.append(
                ReturnSample(
                    text=s.text_delta,
                    token_ids=s.ids_delta,
                    index=s.index,
                    finish_reason=s.finish_reason,
                    num_generated_tokens=n,
                    num_prompt_tokens=len(self.prompt_ids),
                    tokens_per_second=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
                    time_to_first_token=(s.first_token_at - self.metadata.queued_at)
                    if s.first_token_at
                    else None,
                    logprobs=s.logprobs_delta if self.params.logprobs else None,
                    error=self.error,
                    **self._prompt_info(s),
                )
            )
            s.text_delta, s.ids_delta, s.logprobs_delta, s.dirty = "", [], [], False
        return out

    def _prompt_info(self, s: SampleProgress) -> dict:
        if s.prompt_info_sent:
            return {}
        s.prompt_info_sent = True
        return {
            "prompt_token_ids": self.prompt_ids,
            "prompt_logprobs": self.prompt_logprobs,
            "num_cached_tokens": self.num_cached_tokens,
        }

    def fail(self, reason: str) -> None:
        """End this request with an error; the consumer gets RequestFailedError(reason)."""
        self.error = reason
        self.finish_all("error")
        self.channel.close(RequestFailedError(reason))
