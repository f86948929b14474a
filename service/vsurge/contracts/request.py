"""What goes into vSurge (GenerationRequest) and what comes out (ReturnSample). Plain data, no JAX."""

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


class EngineUnavailableError(RuntimeError):
    """The engine cannot run: a process of the multi-host group died or stopped answering (HTTP 503)."""


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

    @property
    def start_time(self) -> float:
        """The seed's name for ``created`` (epoch seconds)."""
        return self.created


@dataclass(eq=False)  # a request is one record, tracked by identity
class GenerationRequest:
    """A completion request: the prompt, how to sample it (`sampling`, a SamplingParams) and metadata.

    `prompt` is text (tokenized by vSurge) or token ids. `is_client_side_tokenization`: True, the client
    detokenizes (responses carry the step's token ids, unbuffered, and no text); False, the server does
    (text, with a step that ends inside a multi-byte character held back until it completes).
    ``detokenize`` overrides whether text is produced. The seed's vSurgeRequest (vsurge/seed_api/request.py)
    is this with the seed's positional constructor.
    """

    prompt: str | list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    metadata: vSurgeMetadata | None = None
    is_client_side_tokenization: bool = False
    detokenize: bool | None = None  # None: detokenize unless is_client_side_tokenization
    # True: prompt + max_tokens beyond the context is an error (PromptTooLongError), not a silent cut
    strict_max_tokens: bool = False
    adapter: str | None = None  # the LoRA adapter to apply (its served name); None: the base model

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")

    def sampling_params(self) -> SamplingParams:
        """A copy of the request's sampling parameters (validated by vSurge on submit)."""
        return dataclasses.replace(self.sampling)


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
