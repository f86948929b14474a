"""NVIDIA GPU placement: ``spec.gpu: {count, type}`` -> the ``nvidia.com/gpu`` resource and a node selector.

The NVIDIA device plugin exposes GPUs as the ``nvidia.com/gpu`` extended resource (requested and limited
alike: it cannot be overcommitted). Which GPU a pod lands on is chosen by a node label:

* GKE names its GPUs in lower case (``nvidia-l4``, ``nvidia-h100-80gb``, ...) on the label
  ``cloud.google.com/gke-accelerator``: a ``type`` of that form selects on it;
* elsewhere NVIDIA's GPU feature discovery (part of the GPU Operator) labels nodes with
  ``nvidia.com/gpu.product`` (e.g. ``NVIDIA-H100-80GB-HBM3``): any other ``type`` selects on that.

GKE (and most GPU node pools) taint GPU nodes with ``nvidia.com/gpu``; the pod tolerates it. One replica
runs on one node: its GPUs form the engine mesh (``tp=N`` by default, as for a TPU host).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vsurge_operator import tpu

GPU_RESOURCE = "nvidia.com/gpu"
NODE_LABEL_GKE_ACCELERATOR = "cloud.google.com/gke-accelerator"
NODE_LABEL_GPU_PRODUCT = "nvidia.com/gpu.product"
MAX_GPUS = 16  # GPUs of one node (the largest GPU machines have 16)
_GKE_TYPE = re.compile(r"^nvidia-[a-z0-9-]+$")  # GKE's accelerator names, e.g. nvidia-h100-80gb


@dataclass(frozen=True)
class GpuPlacement:
    """Where one replica runs: ``count`` GPUs of one node, optionally of one ``type``."""

    count: int
    type: str | None = None

    def node_label(self) -> str | None:
        """The node label `type` is matched on (None: no type, any GPU node)."""
        if not self.type:
            return None
        return NODE_LABEL_GKE_ACCELERATOR if _GKE_TYPE.match(self.type) else NODE_LABEL_GPU_PRODUCT

    def node_selector(self) -> dict[str, str]:
        label = self.node_label()
        return {label: self.type} if label and self.type else {}

    def mesh(self) -> str | None:
        """The default engine mesh over the node's GPUs (None for one GPU: the server's default)."""
        return tpu.default_mesh(self.count) if self.count > 1 else None


def placement(raw: dict) -> GpuPlacement:
    """``spec.gpu`` (already validated) -> GpuPlacement."""
    return GpuPlacement(count=int(raw.get("count", 1)), type=raw.get("type") or None)
