"""What goes into vSurge (vSurgeRequest) and what comes out (ReturnSample). Plain data, no JAX."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")


class PromptTooLongError(ValueError):
    """The prompt (plus at least one generated token) does not fit in the engine's max_length."""


class QueueFullError(RuntimeError):
    """The driver's prefill queue is full; retry later (HTTP 429)."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine; others are unaffected. The message gives the reason."""


@dataclass
class vSurgeMetadata:  # noqa: N801 - the seed's name
    """Timestamps of one request's life, filled by vSurge and the driver."""

    id: str = ""
    created: float = field(default_factory=time.time)
    queued_at: float = field(default_factory=time.time)  # epoch seconds: spans need wall-clock times
    prefill_started_at: float | None = None
    prefill_done_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class vSurgeRequest:  # noqa: N801 - the seed's name
    """A completion request. `prompt` is text, or token ids when is_client_side_tokenization is set."""

    prompt: str | list[int]
    max_tokens: int
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    temperature: float = 0.7
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    metadata: vSurgeMetadata | None = None
    is_client_side_tokenization: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    # True: prompt + max_tokens beyond the context is an error (PromptTooLongError), not a silent cut
    strict_max_tokens: bool = False
    detokenize: bool | None = None  # None: detokenize unless is_client_side_tokenization

    @classmethod
    def from_sampling_params(
        cls, prompt: str | list[int], sampling_params: SamplingParams, **kw
    ) -> vSurgeRequest:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in dataclasses.asdict(sampling_params).items() if k in fields}
        return cls(prompt=prompt, **values, **kw)

    def sampling_params(self) -> SamplingParams:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{k: getattr(self, k) for k in names})


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # of token_id in the model's distribution (prompt logprobs only)


@dataclass
class ReturnSample:
    """One sample's progress since the previous yield (text and token_ids are deltas).

    finish_reason is None while running, then one of FINISH_REASONS. Totals (num_generated_tokens,
    tokens_per_second, time_to_first_token) describe the whole sample so far.
    """

    text: str
    token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    tokens_per_second: float = 0.0
    time_to_first_token: float | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    # Sent once, with a request's first delta of each sample: the prompt's token ids, its logprobs (when
    # prompt_logprobs was asked; entry 0 is None) and how many prompt tokens came from the prefix cache.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
