"""The seed's API (EasyDeL's vSurge) as an edge over the core: what exists only so a program written for
the seed runs unchanged. The core takes one EngineConfig; the classes here take the seed's arguments.

- `engines.py`: vEngine and oEngine, the core's DenseEngine and PagedEngine with the seed's positional
  constructors and the seed's steps beside theirs (`engine_layer.py`: what both add and `seed_forms`;
  `dense.py`, `paged.py`, `paged_prefix.py`: the steps; `types.py`: the seed's result shapes).
- `surge.py`: vSurge, a Surge with the seed's `create_vdriver` / `create_odriver` and response helpers.
- `request.py`: vSurgeRequest, a GenerationRequest with the seed's positional constructor and its sampling
  fields read and written through as attributes.
- `args.py`: a signature's defaults told apart from values given; `protocols.py`: the seed's
  AbstractInferenceEngine and AbstractDriver.

The core (contracts ... cli) never imports this package (tests/test_import_layers.py); the facade does.
"""
