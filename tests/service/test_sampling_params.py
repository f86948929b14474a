"""SamplingParams: defaults, normalization, and one clear error per invalid field."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from vsurge.contracts.sampling_params import (
    ANY_VALUE,
    DRAFTS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    WHEN_OFF,
    InvalidSamplingParams,
    SamplingParams,
)


def test_defaults_are_valid_and_openai_like():
    p = SamplingParams()
    p.validate()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop is None and p.stop_token_ids is None and p.seed is None
    assert (p.ignore_eos, p.min_tokens, p.n, p.logprobs, p.top_logprobs) == (False, 0, 1, False, 0)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_single_stop_string_is_normalized_to_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_boundary_values_are_accepted():
    SamplingParams(
        max_tokens=1,
        temperature=0.0,
        top_p=1e-6,
        top_k=0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1e-3,
        min_tokens=1,
        n=MAX_N,
        logprobs=True,
        top_logprobs=MAX_TOP_LOGPROBS,
        stop=["x"] * MAX_STOP_STRINGS,
        stop_token_ids=[0, 2],
        seed=2**64 - 1,
    ).validate()
    SamplingParams(temperature=2.0, top_k=10**6, seed=-(2**63), min_p=0.0).validate()


INVALID = [
    ("max_tokens", {"max_tokens": 0}, ">= 1"),
    ("max_tokens", {"max_tokens": 2.5}, ">= 1"),
    ("max_tokens", {"max_tokens": True}, ">= 1"),
    ("temperature", {"temperature": -0.1}, "[0, 2]"),
    ("temperature", {"temperature": 2.01}, "[0, 2]"),
    ("temperature", {"temperature": math.nan}, "[0, 2]"),
    ("temperature", {"temperature": "1"}, "[0, 2]"),
    ("top_p", {"top_p": 0.0}, "(0, 1]"),
    ("top_p", {"top_p": 1.5}, "(0, 1]"),
    ("top_k", {"top_k": -1}, ">= 0"),
    ("top_k", {"top_k": 1.0}, ">= 0"),
    ("min_p", {"min_p": -0.01}, "[0, 1]"),
    ("min_p", {"min_p": 1.01}, "[0, 1]"),
    ("presence_penalty", {"presence_penalty": 2.5}, "[-2, 2]"),
    ("frequency_penalty", {"frequency_penalty": -2.5}, "[-2, 2]"),
    ("repetition_penalty", {"repetition_penalty": 0.0}, "> 0"),
    ("repetition_penalty", {"repetition_penalty": math.inf}, "> 0"),
    ("min_tokens", {"min_tokens": 17}, "[0, max_tokens=16]"),
    ("min_tokens", {"min_tokens": -1}, "[0, max_tokens=16]"),
    ("n", {"n": 0}, f"[1, {MAX_N}]"),
    ("n", {"n": MAX_N + 1}, f"[1, {MAX_N}]"),
    ("logprobs", {"logprobs": 1}, "boolean"),
    ("ignore_eos", {"ignore_eos": "yes"}, "boolean"),
    ("top_logprobs", {"top_logprobs": 21, "logprobs": True}, f"[0, {MAX_TOP_LOGPROBS}]"),
    ("top_logprobs", {"top_logprobs": -1, "logprobs": True}, f"[0, {MAX_TOP_LOGPROBS}]"),
    ("top_logprobs", {"top_logprobs": 5}, "unless logprobs is true"),
    ("stop", {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"at most {MAX_STOP_STRINGS}"),
    ("stop", {"stop": ["ok", ""]}, "non-empty"),
    ("stop", {"stop": ["ok", 3]}, "non-empty"),
    ("stop", {"stop": 5}, "list of strings"),
    ("stop_token_ids", {"stop_token_ids": [1, -2]}, ">= 0"),
    ("stop_token_ids", {"stop_token_ids": 7}, ">= 0"),
    ("seed", {"seed": 2**64}, "integer"),
    ("seed", {"seed": 1.5}, "integer"),
]


@pytest.mark.parametrize(
    ("field", "kwargs", "allowed"), INVALID, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(INVALID)]
)
def test_invalid_field_names_field_and_range(field, kwargs, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).validate()
    err = info.value
    assert isinstance(err, InvalidSamplingParams)
    assert err.param == field
    assert str(err).startswith(field + " ")
    assert allowed in str(err)


def test_module_has_no_jax_dependency():
    # The server validates requests without touching the accelerator stack.
    import vsurge.contracts.sampling_params as sp

    src = Path(sp.__file__).read_text(encoding="utf-8")
    assert "import jax" not in src and "from jax" not in src


def undeclared(cls: type) -> list[str]:
    """The fields of ``cls`` that do not say whether a request may get speculative drafts while they are set."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get(DRAFTS) not in (ANY_VALUE, WHEN_OFF)]


def test_every_option_declares_whether_it_allows_speculative_drafts():
    # a new option must say it (spec_verify.plain_sampling reads the declarations), not be left out of a list
    assert undeclared(SamplingParams) == []
    later = dataclasses.make_dataclass("Later", [("new_option", int, 0)], bases=(SamplingParams,))
    assert undeclared(later) == ["new_option"]
