"""The seed's vSurgeRequest: a GenerationRequest built with the seed's positional constructor, whose
sampling fields read and write through as attributes (`request.temperature = 0.2`), as the seed's do."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..contracts.request import GenerationRequest, vSurgeMetadata
from ..contracts.sampling_params import SamplingParams
from .args import default, given

# The seed's vSurgeRequest samples at temperature 0.7 unless told otherwise; SamplingParams (and so the HTTP
# API) keeps OpenAI's 1.0. Only these differ.
SEED_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.7}
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class vSurgeRequest(GenerationRequest):  # noqa: N801 - the seed's name
    """The seed's constructor: `vSurgeRequest(prompt, max_tokens, top_p, top_k, min_p, temperature,
    presence_penalty, frequency_penalty, repetition_penalty, metadata, is_client_side_tokenization)`, with
    the seed's defaults (`SEED_SAMPLING_DEFAULTS` where they differ from SamplingParams'); every other
    SamplingParams field is a keyword too (`seed=`, `n=`, `stop=`, `logit_bias=` ...). They build
    `sampling`; given ``sampling=``, only the arguments passed override it. Sampling fields read and write
    through as attributes: `request.temperature = 0.2` before `complete()` is what the driver samples with
    (the request is a record the driver reads at submission, as the seed's is).
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
        super().__init__(
            prompt,
            sampling,
            metadata=metadata,
            is_client_side_tokenization=is_client_side_tokenization,
            detokenize=detokenize,
            strict_max_tokens=strict_max_tokens,
            adapter=adapter,
        )

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
