"""The seed's vEngine and oEngine: the core engines (DenseEngine, PagedEngine: one EngineConfig) with the
seed's constructors and the seed's steps beside theirs (dense.py, paged.py; `seed_forms` dispatches a call
in the seed's form to them).

The seed's arguments come in the seed's order over ``config`` (an EngineConfig; default: every default),
then the keyword options (``vEngine(model, tok, 4, max_length=300)``); an argument left at its default
keeps the config's value (args.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..contracts.engine_config import DEFAULT_SEED, EngineConfig
from ..engines.dense.vengine import DenseEngine
from ..engines.paged.oengine import PagedEngine
from ..engines.paged.paging import HBMPageManager, PagedAttentionCache
from .args import ENGINE_ARGS, default, seed_engine_config
from .dense import DenseSeedLayer
from .engine_layer import seed_forms
from .paged import PagedSeedLayer

__all__ = ["oEngine", "vEngine"]


@seed_forms  # the seed's prefill / decode / insert / bulk_insert beside the engine's (dense.py)
class vEngine(DenseSeedLayer, DenseEngine):  # noqa: N801 - the seed's name
    def __init__(
        self,
        model: Any,
        processor: Any,
        max_concurrent_decodes: int | None = None,
        max_concurrent_prefill: int | None = None,
        prefill_lengths: Sequence[int] | int | None = None,
        max_prefill_length: int | None = None,
        max_length: int | None = None,
        batch_size: int | None = None,
        seed: int = default(DEFAULT_SEED),
        *,
        config: EngineConfig | None = None,
        **kw: Any,
    ):
        seed_values = {k: v for k, v in locals().items() if k in ENGINE_ARGS}  # the seed's, as passed
        config = seed_engine_config(config, "vdriver", seed_values, kw, third=max_concurrent_decodes)
        super().__init__(model, processor, config)
        self._seed_setup()


@seed_forms  # the seed's decode beside the engine's; forward, prefill / insert, free_resource (paged.py)
class oEngine(PagedSeedLayer, PagedEngine):  # noqa: N801 - the seed's name
    def __init__(
        self,
        model: Any,
        processor: Any,
        storage: PagedAttentionCache | None = None,
        manager: HBMPageManager | None = None,
        max_concurrent_decodes: int | None = None,
        max_concurrent_prefill: int | None = None,
        prefill_lengths: Sequence[int] | int | None = None,
        max_prefill_length: int | None = None,
        max_length: int | None = None,
        batch_size: int | None = None,
        seed: int = default(DEFAULT_SEED),
        *,
        config: EngineConfig | None = None,
        **kw: Any,
    ):
        seed_values = {k: v for k, v in locals().items() if k in ENGINE_ARGS}  # the seed's, as passed
        config = seed_engine_config(config, "odriver", seed_values, kw, third=storage)
        storage = None if isinstance(storage, EngineConfig) else storage
        super().__init__(model, processor, config, storage, manager)
        self._seed_setup()
