"""Compiled programs kept across starts: JAX's persistent compilation cache (`compilation_cache`), the
store of serialized executables (`executable_store`), one read of them at a time (`cache_reads`), no JAX
cache entry for what the store keeps (`cache_writes`) and the signatures that keep a tampered file from
being loaded (`cache_signing`).
"""
