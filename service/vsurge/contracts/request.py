"""What goes into vSurge (vSurgeRequest) and what comes out (ReturnSample). Plain data, no JAX."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from ..seed_args import default, given
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


# The seed's vSurgeRequest samples at temperature 0.7 unless told otherwise; SamplingParams (and so the HTTP
# API) keeps OpenAI's 1.0. Only these differ.
SEED_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.7}
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class vSurgeRequest:  # noqa: N801 - the seed's name
    """A completion request: the prompt, how to sample it (`sampling`, a SamplingParams) and metadata.

    The seed's constructor: `vSurgeRequest(prompt, max_tokens, top_p, top_k, min_p, temperature,
    presence_penalty, frequency_penalty, repetition_penalty, metadata, is_client_side_tokenization)`, with
    the seed's defaults (`SEED_SAMPLING_DEFAULTS` where they differ from SamplingParams'); every other
    SamplingParams field is a keyword too (`seed=`, `n=`, `stop=`, `logit_bias=` ...). They build
    `sampling`; given ``sampling=``, only the arguments passed override it. Sampling fields read and write
    through as attributes: `request.temperature = 0.2` before `complete()` is what the driver samples with
    (the request is a record the driver reads at submission, as the seed's is).

    `prompt` is text (tokenized by the server) or token ids. `is_client_side_tokenization` is the seed's
    response mode: True, the client detokenizes (responses carry the step's token ids, unbuffered, and no
    text); False, the server does (text, with a step that ends inside a multi-byte character held back
    until it completes). ``detokenize`` overrides whether text is produced.
    """

    def __init__(
        self,
        prompt: str | list[int],
        max_tokens: int | None = None,
        top_p: float = default(1.0),
        top_k: int = default(0),
        min_p: float = default(0.0),
        temperature: float = default(SEED_SAMPLING_DEFAULTS["temperature"]),
        presence_penalty: float = default(0.0),
        frequency_penalty: float = default(0.0),
        repetition_penalty: float = default(1.0),
        metadata: vSurgeMetadata | None = None,
        is_client_side_tokenization: bool = False,
        *,
        sampling: SamplingParams | None = None,
        detokenize: bool | None = None,
        strict_max_tokens: bool = False,
        adapter: str | None = None,
        **sampling_kw: Any,
    ) -> None:
        unknown = set(sampling_kw) - _SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"vSurgeRequest got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        seed_args = given(
            dict(
                max_tokens=max_tokens,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                temperature=temperature,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty,
            )
        )
        changes = {**seed_args, **sampling_kw}
        if sampling is None:
            sampling = SamplingParams(**{**SEED_SAMPLING_DEFAULTS, **changes})
        elif changes:
            sampling = dataclasses.replace(sampling, **changes)
        self.prompt = prompt
        self.sampling = sampling
        self.metadata = metadata
        self.is_client_side_tokenization = is_client_side_tokenization
        self.detokenize = detokenize  # None: detokenize unless is_client_side_tokenization
        # True: prompt + max_tokens beyond the context is an error (PromptTooLongError), not a silent cut
        self.strict_max_tokens = strict_max_tokens
        self.adapter = adapter  # the LoRA adapter to apply (its served name); None: the base model

    def __getattr__(self, name: str) -> Any:
        # only reached for names not set on the instance: the sampling fields read through
        if name in _SAMPLING_FIELDS:
            return getattr(self.__dict__["sampling"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SAMPLING_FIELDS:
            # a new SamplingParams, so one shared with other requests (from_sampling_params) is not changed
            value, name = dataclasses.replace(self.__dict__["sampling"], **{name: value}), "sampling"
        elif name == "sampling" and not isinstance(value, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(value).__name__}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"vSurgeRequest(prompt={self.prompt!r:.60}, sampling={self.sampling!r})"

    @classmethod
    def from_sampling_params(
        cls, prompt: str | list[int], sampling_params: SamplingParams, **kw: Any
    ) -> vSurgeRequest:
        return cls(prompt, sampling=sampling_params, **kw)

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
