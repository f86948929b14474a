"""Host arrays placed on a sharding without a collective, also when the sharding spans processes.

``jax.device_put`` onto a sharding with devices of other processes first checks with them that the value
is the same everywhere (a collective). In a multi-host group (vsurge/multihost) every process computes
the same host inputs from the same call, so each one can fill its own devices' shards from its own copy:
a request's arrays are placed once, as one global array, with no cross-host traffic. A single process
gets a plain ``device_put``.
"""

from __future__ import annotations

from typing import Any

import jax


def put_host(value: Any, sharding: Any) -> jax.Array:
    """``value`` (a host array) as a global array on ``sharding``; no collective."""
    if jax.process_count() == 1 or sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
