"""What every layer speaks, importable without jax: EngineConfig and its env/flag parsing
(`engine_config`, `env_options`), SamplingParams (`sampling_params`), the request and its results
(`request`) and the token budget a request spends (`token_budget`). The router and the operator import
only this layer.
"""
