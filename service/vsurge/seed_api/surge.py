"""The seed's vSurge: a Surge with the seed's constructors and response helpers.

`create_vdriver` / `create_odriver` take the seed's arguments in the seed's order over a ``config`` (an
EngineConfig; default: every default), then any other EngineConfig knob by keyword; an argument left at
its default keeps the config's value (args.py). The core (`Surge.from_config`) takes the config alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..contracts.engine_config import DEFAULT_SEED, EngineConfig
from ..contracts.request import ReturnSample
from ..contracts.stream_steps import merge_steps
from ..surge import Surge
from .args import default, seed_engine_config


class vSurge(Surge):  # noqa: N801 - the seed's name
    def __init__(self, driver: Any, vsurge_name: str | None = None):
        super().__init__(driver, vsurge_name)

    @property
    def vsurge_name(self) -> str:
        return self.name

    # ------------------------------------------------------------------ construction
    @classmethod
    def _build_engine(
        cls, model: Any, processor: Any, config: EngineConfig, storage: Any, manager: Any
    ) -> Any:
        from .engines import oEngine, vEngine  # the seed's engine classes: its steps beside the core's

        if config.driver == "odriver":
            return oEngine(model, processor, storage, manager, config=config)
        return vEngine(model, processor, config=config)

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
        return cls.from_config(model, processor, EngineConfig.build(config, **kw), name=vsurge_name)

    @classmethod
    def create_vdriver(
        cls,
        model: Any,
        processor: Any,
        max_concurrent_decodes: int | None = None,
        prefill_lengths: Sequence[int] | int | None = None,
        max_prefill_length: int | None = None,
        max_length: int | None = None,
        seed: int = default(DEFAULT_SEED),
        vsurge_name: str | None = None,
        *,
        config: EngineConfig | None = None,
        **kw: Any,
    ) -> vSurge:
        """One vEngine doing both prefill and decode, driven by a vDriver, e.g. ``create_vdriver(model,
        tok, 32, max_length=1024)``. The knobs, their defaults and their checks are EngineConfig's
        (``max_concurrent_prefill``: how many waiting prompts one prefill call packs together)."""
        seed_values = dict(
            max_concurrent_decodes=max_concurrent_decodes,
            prefill_lengths=prefill_lengths,
            max_prefill_length=max_prefill_length,
            max_length=max_length,
            seed=seed,
        )
        config = seed_engine_config(config, "vdriver", seed_values, kw, third=max_concurrent_decodes)
        return cls.from_config(model, processor, config, name=vsurge_name)

    @classmethod
    def create_odriver(
        cls,
        model: Any,
        processor: Any,
        storage: Any = None,
        manager: Any = None,
        page_size: int = default(128),
        hbm_utilization: float = default(0.6),
        max_concurrent_prefill: int | None = None,
        max_concurrent_decodes: int | None = None,
        prefill_lengths: Sequence[int] | int | None = None,
        max_prefill_length: int | None = None,
        max_length: int | None = None,
        seed: int = default(DEFAULT_SEED),
        vsurge_name: str | None = None,
        *,
        config: EngineConfig | None = None,
        **kw: Any,
    ) -> vSurge:
        """One paged oEngine driven by an oDriver; the seed's arguments in its order, ``config`` and
        keywords as in create_vdriver.

        The KV pages take ``hbm_utilization`` of the free device memory JAX reports, or ``kv_cache_bytes``
        (required to size it exactly; on CPU, where JAX reports none, a small default applies). Prompts
        longer than the largest prefill bucket are prefilled in chunks. ``storage`` / ``manager``: a
        PagedAttentionCache / HBMPageManager to use instead of new ones.
        """
        seed_values = dict(
            page_size=page_size,
            hbm_utilization=hbm_utilization,
            max_concurrent_prefill=max_concurrent_prefill,
            max_concurrent_decodes=max_concurrent_decodes,
            prefill_lengths=prefill_lengths,
            max_prefill_length=max_prefill_length,
            max_length=max_length,
            seed=seed,
        )
        config = seed_engine_config(config, "odriver", seed_values, kw, third=storage)
        storage = None if isinstance(storage, EngineConfig) else storage
        return cls.from_config(model, processor, config, name=vsurge_name, storage=storage, manager=manager)

    # ------------------------------------------------------------------ the seed's response helpers
    def process_client_side_tokenization_response(self, response: list[ReturnSample]) -> list[ReturnSample]:
        """A step of a client-side-tokenization request, as it is (a new list of the same samples)."""
        return list(response)

    def should_buffer_response(self, response: list[ReturnSample]) -> bool:
        """True if a running sample of this step ends inside a multi-byte character (a ``<0xAB>`` byte
        token, or token ids whose text ends in U+FFFD): its text comes with a later step."""
        return self._ends_inside_character(response)

    def process_server_side_tokenization_response(
        self, response: list[ReturnSample], buffered_response_list: list[list[ReturnSample]]
    ) -> list[ReturnSample]:
        """The buffered steps and this one as one ReturnSample per sample: text, token ids and logprobs
        joined, the totals (tokens per second, generated tokens) and the finish reason of the latest."""
        return merge_steps(response, buffered_response_list)
