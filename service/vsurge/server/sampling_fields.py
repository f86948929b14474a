"""Request fields -> validated SamplingParams, and the fields this server refuses rather than ignores.

Pure functions raising `APIError` (400, naming the field). Where vLLM's server words an error in a way
clients match on (seed range, out-of-vocabulary ids), its wording is part of the message; `param` stays ours.
"""

from __future__ import annotations

from typing import Any

from vsurge.contracts.sampling_params import InvalidSamplingParams, SamplingParams

from .errors import invalid_request, unsupported_field
from .schemas import ChatCompletionRequest, CompletionRequest

# vLLM's seed range (a torch.long); pydantic's words for its bounds, which vLLM's clients match on
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Beam search ranks the top 2 * width candidates of each beam; logprobs go up to 20 per token
MAX_BEAM_WIDTH = 10

Request = ChatCompletionRequest | CompletionRequest


# ---------------------------------------------------------------------------------- unsupported fields


def check_unsupported_chat(req: ChatCompletionRequest) -> None:
    """Refuse what would change the output if honoured; accept the harmless 'off' values."""
    if req.functions:
        raise unsupported_field("functions", "function calling is not implemented yet")
    if req.function_call not in (None, "none"):
        raise unsupported_field("function_call", "function calling is not implemented yet")
    if req.audio is not None:
        raise unsupported_field("audio")
    if req.modalities not in (None, ["text"]):
        raise unsupported_field("modalities", "only ['text'] is implemented")
    if req.prediction is not None:
        raise unsupported_field("prediction")
    if req.reasoning_effort is not None:
        raise unsupported_field("reasoning_effort")
    if req.verbosity not in (None, "low", "medium", "high"):
        # accepted and ignored: a hint for OpenAI's reasoning models, nothing a sampler can honour
        raise invalid_request(
            f"Invalid value for 'verbosity': {req.verbosity!r}; expected 'low', 'medium' or 'high'.",
            param="verbosity",
        )
    if req.web_search_options is not None:
        raise unsupported_field("web_search_options")
    _check_common_unsupported(req)


def check_unsupported_completion(req: CompletionRequest) -> None:
    if req.suffix not in (None, ""):
        raise unsupported_field("suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise unsupported_field("best_of", "only best_of == n is implemented")
    if req.prompt_embeds not in (None, [], b"", ""):
        raise unsupported_field("prompt_embeds", "send text or token ids")
    _check_common_unsupported(req)


# vLLM fields accepted with their neutral value only: field -> (neutral values, why it is refused otherwise)
_NEUTRAL_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "priority": ((None, 0), "priority scheduling is not implemented"),
    "include_stop_str_in_output": ((None, False), "stop strings are always left out of the output"),
    "skip_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((None, True), ""),
    "bad_words": ((None, []), "use logit_bias with -100 for the words' tokens"),
    "logits_processors": ((None, []), "custom logits processors cannot be loaded"),
    "kv_transfer_params": ((None, {}), "disaggregated prefill is not implemented"),
    "chat_template": ((None,), "the model's own chat template is used; see chat_template_kwargs"),
    "guided_json": ((None,), "use structured_outputs.json or response_format"),
    "guided_regex": ((None,), "use structured_outputs.regex"),
    "guided_choice": ((None,), "use structured_outputs.choice"),
    "guided_grammar": ((None,), "use structured_outputs.grammar"),
}


def _check_common_unsupported(req: Request) -> None:
    if req.store:
        raise unsupported_field("store", "this server does not store completions")
    for name, (neutral, why) in _NEUTRAL_ONLY.items():
        value = getattr(req, name)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise unsupported_field(name, why)
    if req.truncation_side not in (None, "left", "right"):
        raise invalid_request(
            f"Invalid value for 'truncation_side': {req.truncation_side!r}; expected 'left' or 'right'.",
            param="truncation_side",
        )


def check_seed(seed: Any) -> None:
    """vLLM's seed range, with pydantic's words for the bound (clients match 'less_than_equal')."""
    if seed is None or isinstance(seed, bool) or not isinstance(seed, int):
        return  # a wrong type is caught by SamplingParams.validate, naming the field
    if seed > _INT64_MAX:
        kind, bound = "less_than_equal", f"less than or equal to {_INT64_MAX}"
    elif seed < _INT64_MIN:
        kind, bound = "greater_than_equal", f"greater than or equal to {_INT64_MIN}"
    else:
        return
    raise invalid_request(
        f"Invalid value for 'seed': must be in [-2**63, 2**63 - 1], got {seed} "
        f"({kind}: Input should be {bound}).",
        param="seed",
    )


def check_beam_search(req: Request, *, logprobs: bool, grammar: Any, tools: Any = None) -> None:
    """Beam search ranks by the model's logprobs and returns n beams: what it cannot combine with."""
    if not req.use_beam_search:
        return
    n = req.n or 1
    if n > MAX_BEAM_WIDTH:
        raise invalid_request(
            f"n is the beam width with use_beam_search and must be at most {MAX_BEAM_WIDTH}, got {n}.",
            param="n",
        )
    for name, on in (
        ("logprobs", logprobs),
        ("prompt_logprobs", req.prompt_logprobs is not None),
        ("structured_outputs", grammar is not None),
        ("tools", tools is not None and tools.choice != "none"),
    ):
        if on:
            raise unsupported_field(name, "not with use_beam_search")
    lp = req.length_penalty
    if lp is not None and (isinstance(lp, bool) or not -10.0 <= lp <= 10.0):
        raise invalid_request(
            f"Invalid value for 'length_penalty': must be in [-10, 10], got {lp!r}.", param="length_penalty"
        )


# ------------------------------------------------------------------------------------------ sampling


def max_tokens_for(requested: int | None, default: int, max_length: int, param: str) -> int:
    if requested is None:
        return default
    if requested > max_length:
        raise invalid_request(
            f"{param} is too large: {requested}. This model's maximum context length is {max_length} tokens.",
            param=param,
        )
    return requested


def out_of_vocabulary(what: str, token_id: int, vocab_size: int, param: str) -> Exception:
    # vLLM's words ("out of vocabulary"), the id and the vocabulary size: clients match on each
    return invalid_request(
        f"Token id {token_id} in {what} is out of vocabulary: the model has {vocab_size} tokens "
        f"(ids 0 to {vocab_size - 1}).",
        param=param,
    )


def build_sampling(
    req: Request,
    *,
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
    vocab_size: int | None,
    rename: dict[str, str] | None = None,
) -> SamplingParams:
    """Request fields -> validated SamplingParams; omitted fields keep OpenAI's defaults.

    rename maps a SamplingParams field to the request field that set it (completions' `logprobs` int sets
    `top_logprobs`), so the error names what the client actually sent.
    """
    check_seed(req.seed)
    given = {
        k: getattr(req, k)
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "min_tokens",
            "seed",
            "n",
        )
        if getattr(req, k) is not None
    }
    for k in ("allowed_token_ids", "prompt_logprobs"):
        if getattr(req, k) is not None:
            given[k] = getattr(req, k)
    if req.logit_bias is not None:
        given["logit_bias"] = logit_bias(req.logit_bias)
    if req.use_beam_search:
        given["n"] = 1  # the n beams are searched one engine request at a time (beam_search.py)
    sp = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top_logprobs, **given)
    try:
        sp.validate()
    except InvalidSamplingParams as e:
        param = (rename or {}).get(e.param, e.param)
        raise invalid_request(str(e).replace(e.param, param, 1), param=param) from None
    if vocab_size:
        # top_k at or above the vocabulary filters nothing; capping keeps a huge value out of int32 on device.
        if sp.top_k >= vocab_size:
            sp.top_k = 0
        for name, ids in (
            ("stop_token_ids", sp.stop_token_ids or ()),
            ("logit_bias", sp.logit_bias or ()),
            ("allowed_token_ids", sp.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise out_of_vocabulary(name, bad, vocab_size, name)
    return sp


def logit_bias(raw: dict[str, float]) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings); keys that are no ids are the client's 400,
    every one of them named (vLLM reports them together)."""
    bad = [key for key in raw if not key.isascii() or not key.strip().isdigit()]
    if bad:
        shown = ", ".join(repr(k[:40]) for k in bad[:10]) + (" ..." if len(bad) > 10 else "")
        raise invalid_request(
            f"Invalid key(s) in 'logit_bias': {shown} {'is' if len(bad) == 1 else 'are'} not token ids.",
            param="logit_bias",
        )
    return {int(key): value for key, value in raw.items()}


def stream_flags(req: Request) -> tuple[bool, bool, bool]:
    stream = bool(req.stream)
    so = req.stream_options
    # vLLM lets an empty stream_options through without stream; anything in it needs a stream
    if so is not None and not stream and (so.model_fields_set or so.model_extra):
        raise invalid_request("stream_options is only allowed when stream is true.", param="stream_options")
    include = bool(so and so.include_usage)
    continuous = bool(so and so.continuous_usage_stats)
    return stream, include, continuous
