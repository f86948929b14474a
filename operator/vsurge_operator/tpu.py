"""TPU placement tables: GKE accelerator + topology -> chips, hosts, chips per host, and a default mesh.

GKE schedules a TPU slice by two node labels (``cloud.google.com/gke-tpu-accelerator`` and
``cloud.google.com/gke-tpu-topology``) and the ``google.com/tpu`` extended resource. A slice that spans
several hosts (VMs) needs one pod per host, started together, which is why multi-host placements are
served by a LeaderWorkerSet instead of a Deployment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NODE_LABEL_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
NODE_LABEL_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"

# Tensor parallelism beyond 8 chips rarely pays for serving (KV heads of most models are <= 8);
# larger slices get data parallelism across groups of 8 chips instead.
DEFAULT_MAX_TP = 8


@dataclass(frozen=True)
class _Shape:
    chips: int
    hosts: int


def _single(chips: int) -> _Shape:
    return _Shape(chips=chips, hosts=1)


def _multi(chips: int, chips_per_host: int = 4) -> _Shape:
    return _Shape(chips=chips, hosts=chips // chips_per_host)


# v5e and v6e: 2D topologies; 1, 4 or 8 chips fit on one host, larger slices use 4-chip hosts.
_V5E_V6E: dict[str, _Shape] = {
    "1x1": _single(1),
    "2x2": _single(4),
    "2x4": _single(8),
    "4x4": _multi(16),
    "4x8": _multi(32),
    "8x8": _multi(64),
    "8x16": _multi(128),
    "16x16": _multi(256),
}

# v5e "device" node pools are single-host only.
_V5E_DEVICE: dict[str, _Shape] = {k: v for k, v in _V5E_V6E.items() if v.hosts == 1}

# v4 and v5p: 3D topologies, 4 chips per host; 2x2x1 is the only single-host slice.
_V4_V5P: dict[str, _Shape] = {
    "2x2x1": _single(4),
    "2x2x2": _multi(8),
    "2x2x4": _multi(16),
    "2x4x4": _multi(32),
    "4x4x4": _multi(64),
    "4x4x8": _multi(128),
    "4x8x8": _multi(256),
    "8x8x8": _multi(512),
    "8x8x16": _multi(1024),
    "8x16x16": _multi(2048),
    "16x16x16": _multi(4096),
    "16x16x24": _multi(6144),
}

# accelerator node label value -> (generation, topology table)
ACCELERATORS: dict[str, tuple[str, dict[str, _Shape]]] = {
    "tpu-v5-lite-podslice": ("v5e", _V5E_V6E),
    "tpu-v5-lite-device": ("v5e", _V5E_DEVICE),
    "tpu-v5p-slice": ("v5p", _V4_V5P),
    "tpu-v6e-slice": ("v6e", _V5E_V6E),
    "tpu-v4-podslice": ("v4", _V4_V5P),
}


class PlacementError(ValueError):
    """An accelerator or topology that GKE cannot schedule; ``field`` names the offending spec field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class TpuPlacement:
    """Where one replica of a model runs: a whole TPU slice."""

    accelerator: str
    topology: str
    generation: str
    chips: int
    hosts: int

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    def node_selector(self) -> dict[str, str]:
        return {NODE_LABEL_ACCELERATOR: self.accelerator, NODE_LABEL_TOPOLOGY: self.topology}

    def mesh(self, max_tp: int = DEFAULT_MAX_TP) -> str:
        """Default engine mesh over every chip of the slice, e.g. ``tp=8`` or ``dp=2,tp=8``."""
        return default_mesh(self.chips, max_tp=max_tp)


def default_mesh(chips: int, max_tp: int = DEFAULT_MAX_TP) -> str:
    """``tp=N`` for up to ``max_tp`` chips, else ``dp=chips/tp,tp=max_tp`` (chips are powers of two here)."""
    if chips < 1:
        raise ValueError("chips must be >= 1")
    tp = math.gcd(chips, max_tp) if chips > max_tp else chips
    dp = chips // tp
    return f"tp={tp}" if dp == 1 else f"dp={dp},tp={tp}"


def valid_topologies(accelerator: str) -> list[str]:
    """Topologies GKE offers for an accelerator, smallest first; empty for an unknown accelerator."""
    table = ACCELERATORS.get(accelerator, ("", {}))[1]
    return sorted(table, key=lambda t: (table[t].chips, t))


def placement(accelerator: str, topology: str) -> TpuPlacement:
    """Look up a slice; raises :class:`PlacementError` naming the field that is wrong."""
    if accelerator not in ACCELERATORS:
        raise PlacementError(
            "spec.tpu.accelerator",
            f"unknown TPU accelerator {accelerator!r} (supported: {', '.join(sorted(ACCELERATORS))})",
        )
    generation, table = ACCELERATORS[accelerator]
    shape = table.get(topology)
    if shape is None:
        raise PlacementError(
            "spec.tpu.topology",
            f"topology {topology!r} is not offered for {accelerator} "
            f"(valid: {', '.join(valid_topologies(accelerator))})",
        )
    return TpuPlacement(
        accelerator=accelerator,
        topology=topology,
        generation=generation,
        chips=shape.chips,
        hosts=shape.hosts,
    )
