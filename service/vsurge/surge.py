"""vSurge: the async generation API over a driver (the seed's vSurge, vSurgeRequest)."""

from __future__ import annotations

import asyncio
import logging
import numbers
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from .drivers.active_request import ActiveRequest, ReturnChannel
from .drivers.metrics import DriverMetrics, RequestStats
from .drivers.vdriver import vDriver
from .engine_config import EngineConfig
from .engines.vengine import vEngine
from .request import (
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
    ReturnSample,
    vSurgeMetadata,
    vSurgeRequest,
)
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)

__all__ = [
    "EngineConfig",
    "PromptTooLongError",
    "QueueFullError",
    "RequestFailedError",
    "RequestStats",
    "ReturnSample",
    "vSurge",
    "vSurgeMetadata",
    "vSurgeRequest",
]


def _as_mesh(mesh: Any) -> Any:
    """A mesh spec string ('dp=2,tp=4') becomes a Mesh; anything else passes through."""
    if isinstance(mesh, str):
        from .models.sharding import make_mesh

        return make_mesh(mesh)
    return mesh


class vSurge:  # noqa: N801 - the seed's name
    def __init__(self, driver: vDriver, vsurge_name: str | None = None):
        self._driver = driver
        self._name = vsurge_name or driver.driver_name
        self.compile_seconds: float | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        model: Any,
        processor: Any,
        config: EngineConfig | None = None,
        *,
        vsurge_name: str | None = None,
        **kw: Any,
    ) -> vSurge:
        """The driver ``config.driver`` names (vdriver or odriver), built from ``config`` and ``kw``."""
        config = EngineConfig.build(config, **kw)
        create = cls.create_odriver if config.driver == "odriver" else cls.create_vdriver
        return create(model, processor, config, vsurge_name=vsurge_name)

    @classmethod
    def create_vdriver(
        cls,
        model: Any,
        processor: Any,
        config: EngineConfig | None = None,
        *,
        vsurge_name: str | None = None,
        **kw: Any,
    ) -> vSurge:
        """One vEngine doing both prefill and decode, driven by a vDriver.

        ``config`` (an EngineConfig; default: every default) with the keyword arguments applied, e.g.
        ``create_vdriver(model, tok, max_concurrent_decodes=32, max_length=1024)``. The knobs, their defaults
        and their checks are EngineConfig's (``max_concurrent_prefill``: how many waiting prompts one
        prefill call packs together, default 16)."""
        config = EngineConfig.build(config, **kw).replace(driver="vdriver")
        config = config.replace(mesh=_as_mesh(config.mesh))
        engine = vEngine(model, processor, config)
        driver = vDriver(
            engine,
            engine,
            interleaved_mode=config.interleaved_mode,
            detokenizing_blocks=config.detokenizing_blocks,
            max_queue_size=config.max_queue_size,
            max_decode_stall=config.max_decode_stall,
        )
        return cls(driver, vsurge_name)

    @classmethod
    def create_odriver(
        cls,
        model: Any,
        processor: Any,
        config: EngineConfig | None = None,
        *,
        storage: Any = None,
        manager: Any = None,
        vsurge_name: str | None = None,
        **kw: Any,
    ) -> vSurge:
        """One paged oEngine driven by an oDriver; ``config`` and keywords as in create_vdriver.

        The KV pages take ``hbm_utilization`` of the free device memory JAX reports, or ``kv_cache_bytes``
        (required to size it exactly; on CPU, where JAX reports none, a small default applies). Prompts
        longer than the largest prefill bucket are prefilled in chunks. ``storage`` / ``manager``: a
        PagedAttentionCache / HBMPageManager to use instead of new ones.
        """
        from .drivers.odriver import oDriver
        from .engines.oengine import oEngine

        config = EngineConfig.build(config, **kw).replace(driver="odriver")
        config = config.replace(mesh=_as_mesh(config.mesh))
        engine = oEngine(model, processor, config, storage=storage, manager=manager)
        driver = oDriver(
            engine, detokenizing_blocks=config.detokenizing_blocks, max_queue_size=config.max_queue_size
        )
        return cls(driver, vsurge_name)

    # ------------------------------------------------------------------ properties
    @property
    def driver(self) -> vDriver:
        return self._driver

    @property
    def vsurge_name(self) -> str:
        return self._name

    @property
    def processor(self) -> Any:
        return self._driver.processor

    @property
    def _engine(self):
        return self._driver.engines[0]

    @property
    def max_length(self) -> int:
        return min(e.max_length for e in self._driver.engines)

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: the valid token ids (the tokenizer may know fewer)."""
        return int(self._engine.config.vocab_size)

    @property
    def live(self) -> bool:
        """The driver's threads are running (False before start() and once a thread died or stop())."""
        return self._driver.live

    @property
    def max_prompt_length(self) -> int:
        """Longest prompt accepted: the largest prefill bucket (any length for an engine that prefills in
        chunks), and room for one generated token."""
        return min(
            getattr(e, "max_prompt_length", min(e.max_prefill_length, e.max_length - 1))
            for e in self._driver.engines
        )

    @property
    def max_concurrent_decodes(self) -> int:
        return self._driver.get_total_concurrent_requests()

    @property
    def eos_token_ids(self) -> list[int]:
        return self._engine.eos_token_ids

    @property
    def supports_structured_output(self) -> bool:
        """The driver applies token masks (response_format, structured_outputs, tool grammars)."""
        return bool(getattr(self._driver, "supports_structured_output", False))

    def warm_structured(self) -> float:
        """Compile the structured-output programs now (otherwise the first constrained request has them
        compiled on a background thread, and waits); seconds taken."""
        return sum(e.warm_structured() for e in self._driver.engines if hasattr(e, "warm_structured"))

    # ------------------------------------------------------------------ lifecycle
    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        t0 = time.perf_counter()
        self._driver.compile(progress)
        self.compile_seconds = time.perf_counter() - t0
        return self.compile_seconds

    def start(self) -> None:
        self._driver.start()

    def stop(self) -> None:
        self._driver.stop()

    def metrics(self) -> DriverMetrics:
        return self._driver.metrics()

    def add_observer(self, fn: Callable[[RequestStats], None]) -> None:
        self._driver.add_observer(fn)

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: str) -> list[int]:
        tok = self.processor
        if tok is None:
            raise ValueError("this model has no tokenizer: send token ids (is_client_side_tokenization)")
        bos = getattr(tok, "bos_token", None)
        # a chat template already wrote BOS into the text; do not add a second one
        add_special = not (bos and text.startswith(bos))
        return list(tok.encode(text, add_special_tokens=add_special))

    def count_tokens(self, text_or_conversation: str | list) -> int:
        """Tokens of a text, or of a chat conversation rendered with the chat template."""
        if isinstance(text_or_conversation, str):
            return len(self.tokenize(text_or_conversation))
        if isinstance(text_or_conversation, list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in text_or_conversation
        ):
            try:
                ids = self.processor.apply_chat_template(
                    text_or_conversation, tokenize=True, add_generation_prompt=True
                )
            except Exception as e:
                raise ValueError(f"cannot apply the chat template: {e}") from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return len(ids)
        raise ValueError("count_tokens takes a string or a list of {'role', 'content'} messages")

    # ------------------------------------------------------------------ generation
    def _make_active(self, request: vSurgeRequest, loop: asyncio.AbstractEventLoop | None) -> ActiveRequest:
        params = request.sampling_params()
        params.validate()
        if request.is_client_side_tokenization:
            ids = list(request.prompt)
            vocab = self._engine.config.vocab_size
            if not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
            ):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            ids = [int(t) for t in ids]
        elif isinstance(request.prompt, str):
            ids = self.tokenize(request.prompt)
        else:
            raise ValueError("prompt must be a string (or token ids with is_client_side_tokenization)")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) > self.max_prompt_length:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; this model accepts at most {self.max_prompt_length} "
                f"(max_length {self.max_length})"
            )
        if request.strict_max_tokens and len(ids) + params.max_tokens > self.max_length:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_length} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in "
                "the completion). Please reduce the length of the prompt or completion."
            )
        md = request.metadata or vSurgeMetadata()
        return ActiveRequest(
            ids,
            params,
            processor=self.processor,
            detokenize=(not request.is_client_side_tokenization)
            if request.detokenize is None
            else request.detokenize,
            eos_token_ids=self.eos_token_ids,
            metadata=md,
            channel=ReturnChannel(loop),
            model=self._name,
        )

    async def complete(self, request: vSurgeRequest) -> AsyncIterator[list[ReturnSample]]:
        """Stream one request: each item holds the new text/tokens of the samples that advanced.

        Raises before anything is queued on invalid parameters (ValueError) or a prompt that does not fit
        (PromptTooLongError); QueueFullError when the queue is full; RequestFailedError if the request
        fails inside the engine. Closing the generator cancels the request and frees its slots.
        """
        loop = asyncio.get_running_loop()
        if isinstance(request.prompt, str) and len(request.prompt) > 16384:
            # tokenizing a long prompt takes milliseconds: keep it off the loop that feeds every stream
            active = await asyncio.to_thread(self._make_active, request, loop)
        else:
            active = self._make_active(request, loop)
        self._driver.submit_request(active)
        try:
            async for item in active.channel:
                yield item
        finally:
            if not active.done:
                active.cancel()

    def submit(self, request: vSurgeRequest) -> ActiveRequest:
        """Blocking-world entry point (benchmarks, threads): iterate `.channel` for results."""
        active = self._make_active(request, None)
        self._driver.submit_request(active)
        return active

    async def generate(
        self,
        prompts: str | Sequence[str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        stream: bool = False,
    ):
        """Run several prompts concurrently.

        stream=False: one aggregated ReturnSample per prompt (a list of n when that prompt's n > 1); a
        single prompt string gives its result alone, not in a list.
        stream=True: an async generator of list[ReturnSample] items from any request as they arrive.
        """
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            params = [SamplingParams() for _ in prompts]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling_params")
        requests = [vSurgeRequest.from_sampling_params(p, sp) for p, sp in zip(prompts, params, strict=True)]
        if stream:
            return self._stream_many(requests)
        results = await asyncio.gather(*(self._collect(r) for r in requests))
        return results[0] if single else results

    async def _collect(self, request: vSurgeRequest):
        agg: dict[int, ReturnSample] = {}
        async for items in self.complete(request):
            for s in items:
                a = agg.setdefault(
                    s.index,
                    ReturnSample(
                        text="", token_ids=[], index=s.index, logprobs=[] if s.logprobs is not None else None
                    ),
                )
                a.text += s.text
                a.token_ids += s.token_ids
                if s.logprobs is not None:
                    a.logprobs = (a.logprobs or []) + s.logprobs
                a.finish_reason = s.finish_reason
                a.num_generated_tokens = s.num_generated_tokens
                a.num_prompt_tokens = s.num_prompt_tokens
                a.tokens_per_second = s.tokens_per_second
                a.time_to_first_token = s.time_to_first_token
        out = [agg[i] for i in sorted(agg)]
        return out[0] if len(out) == 1 else out

    async def _stream_many(self, requests: list[vSurgeRequest]) -> AsyncIterator[list[ReturnSample]]:
        queue: asyncio.Queue = asyncio.Queue()
        gens = [self.complete(r) for r in requests]

        async def pump(gen):
            try:
                async for item in gen:
                    await queue.put(item)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put(e)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(g)) for g in gens]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
