"""Per-request sampling parameters (host side, no JAX).

`SamplingParams` is what a caller (the OpenAI server, `vSurge.generate`) hands to the engine. It only
carries and validates values; the on-device representation lives in `vsurge.engines.sampling`
(`SlotSampling`), and the host-side parts (stop strings, stop token ids, `ignore_eos`, `max_tokens`) are
enforced by the driver.

`validate()` raises `InvalidSamplingParams` (a `ValueError`) whose message names the field and its allowed
range; its `param` attribute holds the field name so the server can shape an OpenAI 400 error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ANY_VALUE",
    "DRAFTS",
    "WHEN_OFF",
    "InvalidSamplingParams",
    "MAX_ALLOWED_TOKEN_IDS",
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "SamplingParams",
]

MAX_TOP_LOGPROBS = 20
# OpenAI's own cap on logit_bias entries.
MAX_LOGIT_BIAS = 300
# allowed_token_ids and logit_bias share one sparse row per slot on the device (see engines.sampling):
# its width is the most distinct ids the two may name together.
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 16
MAX_N = 128
# The seed is folded into 64 bits of key material; anything in this range maps to a distinct key.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


# Speculative decoding verifies a request's drafts against its plain distribution, softmax(logits / T)
# (engines/dense/spec_verify.py), so an option that changes what is sampled otherwise rules drafts out while
# it is set. Each field declares which it is, under DRAFTS in its metadata: `plain_sampling` reads the
# declarations, and tests/service/test_sampling_params.py fails on a field that declares nothing.
DRAFTS = "drafts"
ANY_VALUE = "any value"  # drafts allowed whatever it is: verification reproduces it, or the host applies it
WHEN_OFF = "when off"  # drafts allowed only while it is off: None, empty, or its default


def _option(default: Any, drafts: str) -> Any:
    """A field of `SamplingParams` with its default and its declaration for speculative drafts."""
    return field(default=default, metadata={DRAFTS: drafts})


def _is_int(value: object) -> bool:
    # bool is an int subclass; `max_tokens=True` is a client bug, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float)) and not isinstance(value, bool)


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; `param` names the field (OpenAI error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _fail(field: str, message: str) -> None:
    raise InvalidSamplingParams(field, message)


@dataclass
class SamplingParams:
    """How to sample one request's output.

    Defaults follow the OpenAI API. ``top_k == 0`` means no top-k filter; ``temperature == 0`` means
    greedy decoding (argmax of the penalized logits). ``stop`` may also be given as a single string; it
    is normalized to a one-element list.
    """

    max_tokens: int = _option(16, ANY_VALUE)
    temperature: float = _option(1.0, ANY_VALUE)
    top_p: float = _option(1.0, WHEN_OFF)
    top_k: int = _option(0, WHEN_OFF)
    min_p: float = _option(0.0, WHEN_OFF)
    presence_penalty: float = _option(0.0, WHEN_OFF)
    frequency_penalty: float = _option(0.0, WHEN_OFF)
    repetition_penalty: float = _option(1.0, WHEN_OFF)
    stop: list[str] | None = _option(None, ANY_VALUE)
    stop_token_ids: list[int] | None = _option(None, ANY_VALUE)
    ignore_eos: bool = _option(False, ANY_VALUE)
    min_tokens: int = _option(0, WHEN_OFF)
    seed: int | None = _option(None, ANY_VALUE)
    n: int = _option(1, ANY_VALUE)
    # a verify step computes top logprobs only for its first position
    logprobs: bool = _option(False, WHEN_OFF)
    top_logprobs: int = _option(0, WHEN_OFF)
    # token id -> added to its logit before sampling (OpenAI: -100..100; -100 bans, 100 all but forces)
    logit_bias: dict[int, float] | None = _option(None, WHEN_OFF)
    # vLLM: sample only among these ids
    allowed_token_ids: list[int] | None = _option(None, WHEN_OFF)
    # vLLM: logprobs of the prompt tokens (None: off; k >= 0: each prompt token's own plus the top k)
    prompt_logprobs: int | None = _option(None, ANY_VALUE)
    # structured output: a compiled grammar (vsurge.structured.CompiledGrammar) the output must match
    grammar: Any = _option(None, WHEN_OFF)

    def __post_init__(self) -> None:
        # OpenAI accepts `stop: "x"`; keep one representation downstream.
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        """True when sampling is deterministic argmax (temperature 0)."""
        return _is_number(self.temperature) and self.temperature == 0

    def validate(self) -> None:
        """Check every field; raise ValueError naming the first bad field and its allowed range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        self._check_range("temperature", self.temperature, 0.0, 2.0, "[0, 2]")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", f"must be an integer >= 0 (0 disables top-k), got {self.top_k!r}")
        self._check_range("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        self._check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        self._check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        rp = self.repetition_penalty
        if not _is_number(rp) or not math.isfinite(rp) or rp <= 0:
            _fail("repetition_penalty", f"must be a finite number > 0, got {rp!r}")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            _fail(
                "min_tokens",
                f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
            )
        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            _fail("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.logprobs, bool):
            _fail("logprobs", f"must be a boolean, got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        tl = self.top_logprobs
        if not _is_int(tl) or not (0 <= tl <= MAX_TOP_LOGPROBS):
            _fail("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {tl!r}")
        if tl > 0 and not self.logprobs:
            _fail("top_logprobs", f"must be 0 unless logprobs is true, got {tl!r}")
        self._check_stop()
        self._check_stop_token_ids()
        self._check_logit_bias()
        self._check_allowed_token_ids()
        pl = self.prompt_logprobs
        if pl is not None and (not _is_int(pl) or not (0 <= pl <= MAX_TOP_LOGPROBS)):
            _fail("prompt_logprobs", f"must be null or an integer in [0, {MAX_TOP_LOGPROBS}], got {pl!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (_SEED_MIN <= self.seed <= _SEED_MAX)):
            _fail("seed", f"must be null or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")

    @staticmethod
    def _check_range(field: str, value: object, lo: float, hi: float, shown: str) -> None:
        # `not (lo <= v <= hi)` also rejects NaN, which compares false with everything.
        if not _is_number(value) or not (lo <= value <= hi):  # type: ignore[operator]
            _fail(field, f"must be in {shown}, got {value!r}")

    def _check_stop(self) -> None:
        if self.stop is None:
            return
        if not isinstance(self.stop, list | tuple):
            _fail("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"must have at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", f"must contain only non-empty strings, got {s!r}")

    def _check_logit_bias(self) -> None:
        lb = self.logit_bias
        if lb is None:
            return
        if not isinstance(lb, dict):
            _fail(
                "logit_bias", f"must be a map of token id to a bias in [-100, 100], got {type(lb).__name__}"
            )
        if len(lb) > MAX_LOGIT_BIAS:
            _fail("logit_bias", f"must have at most {MAX_LOGIT_BIAS} entries, got {len(lb)}")
        for t, b in lb.items():
            if not _is_int(t) or t < 0:
                _fail("logit_bias", f"keys must be token ids (integers >= 0), got {t!r}")
            if not _is_number(b) or not (-100 <= b <= 100):
                _fail("logit_bias", f"values must be in [-100, 100], got {b!r} for token {t}")

    def _check_allowed_token_ids(self) -> None:
        ids = self.allowed_token_ids
        if ids is None:
            return
        if not isinstance(ids, list | tuple) or not ids:
            _fail("allowed_token_ids", "must be a non-empty list of token ids")
        for t in ids:
            if not _is_int(t) or t < 0:
                _fail("allowed_token_ids", f"must contain only integers >= 0, got {t!r}")
        union = set(ids) | set(self.logit_bias or ())
        if len(union) > MAX_ALLOWED_TOKEN_IDS:
            _fail(
                "allowed_token_ids",
                f"together with logit_bias may name at most {MAX_ALLOWED_TOKEN_IDS} distinct ids, got {len(union)}",
            )

    def _check_stop_token_ids(self) -> None:
        if self.stop_token_ids is None:
            return
        if not isinstance(self.stop_token_ids, list | tuple):
            _fail("stop_token_ids", "must be a list of integers >= 0")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _fail("stop_token_ids", f"must contain only integers >= 0, got {t!r}")
