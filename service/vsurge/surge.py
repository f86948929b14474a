"""Surge: the async generation API over a driver, built from one EngineConfig (the seed's vSurge, with
the seed's constructors, is seed_api/surge.py)."""

from __future__ import annotations

import asyncio
import logging
import numbers
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from .contracts.engine_config import EngineConfig
from .contracts.request import (
    GenerationRequest,
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
    ReturnSample,
    vSurgeMetadata,
)
from .contracts.sampling_params import SamplingParams
from .contracts.stream_steps import ends_inside_character, merge_steps
from .drivers import switch_interval
from .drivers.active_request import ActiveRequest, ReturnChannel
from .drivers.dense.vdriver import vDriver
from .drivers.detokenize import make_decode_fn
from .drivers.metrics import DriverMetrics, RequestStats
from .engines.dense.vengine import DenseEngine

log = logging.getLogger(__name__)

__all__ = [
    "EngineConfig",
    "PromptTooLongError",
    "QueueFullError",
    "RequestFailedError",
    "RequestStats",
    "ReturnSample",
    "Surge",
    "vSurgeMetadata",
    "GenerationRequest",
]


def _as_mesh(mesh: Any) -> Any:
    """A mesh spec string ('dp=2,tp=4') becomes a Mesh; anything else passes through."""
    if isinstance(mesh, str):
        from .models.sharding import make_mesh

        return make_mesh(mesh)
    return mesh


class Surge:
    """The async generation API over one driver: what the server runs on (the seed's vSurge,
    vsurge/seed_api/surge.py, is this with the seed's constructors)."""

    def __init__(self, driver: vDriver, name: str | None = None):
        self._driver = driver
        self._name = name or driver.driver_name
        self.compile_seconds: float | None = None
        self._switching = False  # holds a count in drivers/switch_interval.py while started
        self._decode_fn: Callable[[list[int]], str] | None = None  # _ends_inside_character's, made once

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(
        cls,
        model: Any,
        processor: Any,
        config: EngineConfig,
        *,
        name: str | None = None,
        storage: Any = None,
        manager: Any = None,
    ) -> Surge:
        """The engine and driver ``config.driver`` names (vdriver: one dense engine doing both prefill and
        decode, driven by a vDriver; odriver: one paged engine driven by an oDriver), built from
        ``config``. ``storage`` / ``manager`` (odriver): a PagedAttentionCache / HBMPageManager to use
        instead of new ones."""
        config = config.replace(mesh=_as_mesh(config.mesh))
        engine = cls._build_engine(model, processor, config, storage, manager)
        if config.driver == "odriver":
            from .drivers.paged.odriver import oDriver

            driver = oDriver(
                engine, detokenizing_blocks=config.detokenizing_blocks, max_queue_size=config.max_queue_size
            )
            return cls(driver, name)
        driver = vDriver(
            engine,
            engine,
            interleaved_mode=config.interleaved_mode,
            detokenizing_blocks=config.detokenizing_blocks,
            max_queue_size=config.max_queue_size,
        )
        return cls(driver, name)

    @classmethod
    def _build_engine(
        cls, model: Any, processor: Any, config: EngineConfig, storage: Any, manager: Any
    ) -> Any:
        """The engine ``config.driver`` names (the seed's vSurge builds its vEngine / oEngine instead)."""
        if config.driver == "odriver":
            from .engines.paged.oengine import PagedEngine

            return PagedEngine(model, processor, config, storage, manager)
        return DenseEngine(model, processor, config)

    # ------------------------------------------------------------------ properties
    @property
    def driver(self) -> vDriver:
        return self._driver

    @property
    def name(self) -> str:
        """The served model's name (the driver's when none was given)."""
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
        return int(self._engine.model_config.vocab_size)

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
        if not self._switching:
            switch_interval.serving()  # drivers/switch_interval.py
            self._switching = True
        self._driver.start()

    def stop(self) -> None:
        try:
            self._driver.stop()
        finally:
            if self._switching:
                self._switching = False
                switch_interval.stopped()

    def metrics(self) -> DriverMetrics:
        return self._driver.metrics()

    @property
    def lora(self) -> Any:
        """The driver's LoRA adapters (drivers/lora_adapters.py), or None without an adapter bank."""
        return getattr(self._driver, "lora", None)

    def pooler(self) -> Any:
        """The pooled-hidden-state program over this model's weights (/v1/embeddings), made once
        (engines/pooling.py); call its compile() at warm-up."""
        if getattr(self, "_pooler", None) is None:
            from vsurge.engines.pooling import Pooler

            self._pooler = Pooler.for_engine(self._engine)
        return self._pooler

    def add_observer(self, fn: Callable[[RequestStats], None]) -> None:
        self._driver.add_observer(fn)

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: str) -> list[int]:
        tok = self.processor
        if tok is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
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
    def _make_active(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None
    ) -> ActiveRequest:
        params = request.sampling_params()
        params.validate()
        if isinstance(request.prompt, str):
            ids = self.tokenize(request.prompt)
        elif isinstance(request.prompt, Sequence) or hasattr(request.prompt, "__array__"):
            ids = list(request.prompt)
            vocab = self._engine.model_config.vocab_size
            if not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
            ):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            ids = [int(t) for t in ids]
        else:
            raise ValueError("prompt must be a string or a list of token ids")
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
            model=request.adapter or self._name,  # figures per adapter: its requests carry its name
            adapter=request.adapter,
        )

    async def complete(self, request: GenerationRequest) -> AsyncIterator[list[ReturnSample]]:
        """Stream one request: each item holds the new text/tokens of the samples that advanced.

        As the seed's: with ``request.is_client_side_tokenization`` the steps pass through unchanged;
        otherwise a step that ends inside a multi-byte character is buffered and merged with the steps
        after it (contracts/stream_steps.py), so each item's token ids produce its text.

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
        client_side = request.is_client_side_tokenization
        self._driver.submit_request(active)
        buffered: list[list[ReturnSample]] = []
        try:
            async for step in active.channel:
                if client_side:
                    yield list(step)
                elif self._ends_inside_character(step):
                    buffered.append(step)
                else:
                    yield merge_steps(step, buffered)
                    buffered = []
            if buffered:  # the stream ended (cancelled, failed) inside a character: what there is
                yield merge_steps([], buffered)
        finally:
            if not active.done:
                active.cancel()

    def _ends_inside_character(self, response: list[ReturnSample]) -> bool:
        """True if a running sample of this step ends inside a multi-byte character (a ``<0xAB>`` byte
        token, or token ids whose text ends in U+FFFD): its text comes with a later step."""
        tok = self.processor
        if tok is None:
            return False
        if self._decode_fn is None:
            self._decode_fn = make_decode_fn(tok, skip_special_tokens=False)
        convert = getattr(tok, "convert_ids_to_tokens", None)
        return ends_inside_character(response, self._decode_fn, convert)

    def submit(self, request: GenerationRequest) -> ActiveRequest:
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
        """Run several prompts concurrently (a prompt: text, or a list of token ids).

        stream=False: a list of aggregated ReturnSample, one per prompt in order (a single prompt too);
        a prompt with n > 1 gives its n samples in a row, ``index`` 0..n-1.
        stream=True: an async generator of list[ReturnSample] items from any request as they arrive.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], numbers.Integral)
        )
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            params = [SamplingParams() for _ in prompts]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling_params")
        requests = [GenerationRequest(p, sp) for p, sp in zip(prompts, params, strict=True)]
        if stream:
            return self._stream_many(requests)
        results = await asyncio.gather(*(self._collect(r) for r in requests))
        return [sample for samples in results for sample in samples]

    async def _collect(self, request: GenerationRequest) -> list[ReturnSample]:
        """Every step of one request merged: one ReturnSample per sample, in index order."""
        steps = [step async for step in self.complete(request)]
        merged = merge_steps([], steps)
        return sorted(merged, key=lambda s: s.index)

    async def _stream_many(self, requests: list[GenerationRequest]) -> AsyncIterator[list[ReturnSample]]:
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
