"""The seed's API (EasyDeL's vSurge) as an edge over the core: what exists only so a program written for
the seed runs unchanged.

- `surge.py`: vSurge, a Surge with the seed's `create_vdriver` / `create_odriver` (the seed's positional
  arguments over an EngineConfig) and its response helpers.
- `request.py`: vSurgeRequest, a GenerationRequest with the seed's positional constructor and its sampling
  fields read and written through as attributes.
- `protocols.py`: the seed's AbstractInferenceEngine and AbstractDriver.

The core (contracts ... cli) never imports this package (tests/test_import_layers.py); the facade does.
"""
