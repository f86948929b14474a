"""The render routes the Kubernetes inference gateway's endpoint picker calls (vLLM's shape):
POST /v1/chat/completions/render and /v1/completions/render.

A render is a generation request planned and tokenized exactly as the generation route would feed the
engine (the same plan_chat / plan_completion, chat template, tokenization options and tokenizer rule),
then answered instead of run: vLLM's generate-request object (`request_id`, `token_ids`, `features`,
`sampling_params`, `model`, `stream`, ...) — one for a chat, a list (one per prompt) for completions —
plus `prompt`, the rendered text (the decoded ids for a token-id prompt), and `prompt_token_ids`, the ids
again under the name vLLM's earlier completions render answered with.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .errors import invalid_request
from .parsing import GenerationPlan
from .served_model import _decode
from .wire import dumps


def vllm_sampling_params(plan: GenerationPlan) -> dict[str, Any]:
    """The plan's sampling parameters under vLLM's SamplingParams names."""
    sp = plan.sampling
    logprobs = None
    if sp.logprobs:
        logprobs = sp.top_logprobs if plan.operation != "chat" else max(sp.top_logprobs, 0)
    return {
        "n": sp.n,
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "min_p": sp.min_p,
        "seed": sp.seed,
        "stop": list(sp.stop or []),
        "stop_token_ids": list(sp.stop_token_ids or []),
        "ignore_eos": sp.ignore_eos,
        "max_tokens": sp.max_tokens,
        "min_tokens": sp.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": sp.prompt_logprobs,
        "logit_bias": {str(k): v for k, v in (sp.logit_bias or {}).items()} or None,
        "allowed_token_ids": sp.allowed_token_ids,
        "structured_outputs": None
        if plan.grammar is None
        else {"grammar": getattr(plan.grammar, "source", None)},
    }


def generate_request(
    plan: GenerationPlan, prefix: str, token_ids: list[int], prompt: str | None, model: str | None
) -> dict[str, Any]:
    return {
        "request_id": f"{prefix}-{plan.request_id or uuid.uuid4().hex}",
        "token_ids": token_ids,
        # the same ids under the name vLLM's earlier completions render used (its tests read either)
        "prompt_token_ids": token_ids,
        "features": None,  # text-only: no multimodal placeholders
        "sampling_params": vllm_sampling_params(plan),
        "model": model,
        "stream": plan.stream,
        "stream_options": (
            {"include_usage": plan.include_usage, "continuous_usage_stats": plan.continuous_usage}
            if plan.stream
            else None
        ),
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
        "prompt": prompt,
    }


class RenderRoutes:
    """A mixin of vSurgeApiServer (GenerationRoutes, ChatRuns)."""

    async def render_chat(self, request: Request) -> Response:
        return await self._render(request, "chat")

    async def render_completion(self, request: Request) -> Response:
        return await self._render(request, "text_completion")

    async def _render(self, request: Request, operation: str) -> Response:
        call = self._call(request)
        try:
            self._check_auth(request)
            data = await self._json(request)
            if data.get("use_beam_search"):
                raise invalid_request(
                    "Beam search is not supported by the render endpoint.", param="use_beam_search"
                )
            entry, plan = await self._plan(data, operation)
            call.model = entry.name
            call.start_span("render", entry, plan)
            limit = int(getattr(entry.surge, "max_prompt_length", entry.max_length - 1))
            out = []
            for p in plan.prompts:
                ids = list(p) if isinstance(p, list) else await asyncio.to_thread(entry.surge.tokenize, p)
                if len(ids) > limit:
                    raise invalid_request(
                        f"prompt has {len(ids)} tokens; this model accepts at most {limit}",
                        param=plan.prompt_param,
                        code="context_length_exceeded",
                    )
                prefix = "chatcmpl" if operation == "chat" else "cmpl"
                text = p if isinstance(p, str) else _decode(entry, ids)
                out.append(generate_request(plan, prefix, ids, text, data.get("model")))
            call.close(200)
            return Response(dumps(out[0] if operation == "chat" else out), media_type="application/json")
        except Exception as exc:
            return call.fail(exc)
