"""One request type: vSurgeRequest carries the prompt, a SamplingParams and metadata; the seed's
constructor (positional and keyword) keeps working with the seed's own defaults; no field is listed twice."""

import dataclasses

import pytest

from vsurge.contracts.request import vSurgeMetadata
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.seed_api.request import SEED_SAMPLING_DEFAULTS, vSurgeRequest


def test_seed_positional_order_and_defaults():
    md = vSurgeMetadata(id="r1")
    r = vSurgeRequest("hi", 16, 0.9, 5, 0.1, 0.3, 0.2, 0.4, 1.1, md, True)
    s = r.sampling
    assert (s.max_tokens, s.top_p, s.top_k, s.min_p, s.temperature) == (16, 0.9, 5, 0.1, 0.3)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.2, 0.4, 1.1)
    assert r.metadata is md and r.is_client_side_tokenization is True
    # the seed's default temperature is its own; SamplingParams (the HTTP API) keeps OpenAI's
    assert vSurgeRequest("hi", 8).temperature == SEED_SAMPLING_DEFAULTS["temperature"] == 0.7
    assert SamplingParams().temperature == 1.0


def test_keywords_build_the_sampling_params_and_read_through():
    r = vSurgeRequest(prompt=[1, 2], max_tokens=4, seed=3, n=2, stop="x", logit_bias={5: 1.0})
    assert isinstance(r.sampling, SamplingParams)
    assert (r.max_tokens, r.seed, r.n, r.stop, r.logit_bias) == (4, 3, 2, ["x"], {5: 1.0})
    with pytest.raises(AttributeError):
        _ = r.not_a_field
    with pytest.raises(TypeError, match="unexpected keyword"):
        vSurgeRequest("hi", 4, temprature=0.5)
    with pytest.raises(TypeError, match="multiple values"):
        vSurgeRequest("hi", 4, max_tokens=5)


def test_from_sampling_params_keeps_them_and_overrides_apply():
    sp = SamplingParams(max_tokens=3, temperature=0.0, top_k=7)
    r = vSurgeRequest.from_sampling_params("x", sp, strict_max_tokens=True)
    assert r.sampling == sp and r.strict_max_tokens
    assert r.sampling_params() == sp and r.sampling_params() is not sp
    r = vSurgeRequest("x", sampling=sp, top_k=2)
    assert r.top_k == 2 and sp.top_k == 7


def test_no_field_is_listed_twice():
    r = vSurgeRequest("hi", 4)
    own = set(vars(r)) - {"sampling"}
    assert own == {
        "prompt",
        "metadata",
        "is_client_side_tokenization",
        "detokenize",
        "strict_max_tokens",
        "adapter",
    }
    assert not own & {f.name for f in dataclasses.fields(SamplingParams)}
