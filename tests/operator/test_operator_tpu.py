"""TPU placement tables: accelerator + topology -> chips, hosts, chips per host, mesh."""

from __future__ import annotations

import math

import pytest

from vsurge_operator import tpu


@pytest.mark.parametrize(
    ("accelerator", "topology", "chips", "hosts", "per_host", "mesh"),
    [
        ("tpu-v5-lite-podslice", "1x1", 1, 1, 1, "tp=1"),
        ("tpu-v5-lite-podslice", "2x2", 4, 1, 4, "tp=4"),
        ("tpu-v5-lite-podslice", "2x4", 8, 1, 8, "tp=8"),
        ("tpu-v5-lite-podslice", "4x4", 16, 4, 4, "dp=2,tp=8"),
        ("tpu-v5-lite-podslice", "8x16", 128, 32, 4, "dp=16,tp=8"),
        ("tpu-v5-lite-device", "2x4", 8, 1, 8, "tp=8"),
        ("tpu-v6e-slice", "2x4", 8, 1, 8, "tp=8"),
        ("tpu-v6e-slice", "4x8", 32, 8, 4, "dp=4,tp=8"),
        ("tpu-v6e-slice", "16x16", 256, 64, 4, "dp=32,tp=8"),
        ("tpu-v5p-slice", "2x2x1", 4, 1, 4, "tp=4"),
        ("tpu-v5p-slice", "2x2x2", 8, 2, 4, "tp=8"),
        ("tpu-v5p-slice", "4x4x4", 64, 16, 4, "dp=8,tp=8"),
        ("tpu-v4-podslice", "2x2x4", 16, 4, 4, "dp=2,tp=8"),
    ],
)
def test_placement_table(accelerator, topology, chips, hosts, per_host, mesh):
    p = tpu.placement(accelerator, topology)
    assert (p.chips, p.hosts, p.chips_per_host, p.mesh()) == (chips, hosts, per_host, mesh)
    assert p.multi_host == (hosts > 1)
    assert p.node_selector() == {
        "cloud.google.com/gke-tpu-accelerator": accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }


@pytest.mark.parametrize("accelerator", sorted(tpu.ACCELERATORS))
def test_every_table_entry_is_consistent(accelerator):
    topologies = tpu.valid_topologies(accelerator)
    assert topologies
    for topology in topologies:
        p = tpu.placement(accelerator, topology)
        assert p.chips == math.prod(int(d) for d in topology.split("x"))
        assert p.hosts * p.chips_per_host == p.chips
        # A multi-host slice always has 4 chips per host on these generations.
        assert p.chips_per_host in (1, 4, 8) and (p.hosts == 1 or p.chips_per_host == 4)
        assert math.prod(int(part.split("=")[1]) for part in p.mesh().split(",")) == p.chips


def test_generation_labels():
    assert tpu.placement("tpu-v5-lite-podslice", "2x4").generation == "v5e"
    assert tpu.placement("tpu-v5p-slice", "2x2x1").generation == "v5p"
    assert tpu.placement("tpu-v6e-slice", "1x1").generation == "v6e"


@pytest.mark.parametrize(
    ("accelerator", "topology", "field", "text"),
    [
        ("tpu-v9-imaginary", "2x4", "spec.tpu.accelerator", "unknown TPU accelerator"),
        ("tpu-v5-lite-podslice", "2x2x2", "spec.tpu.topology", "valid: 1x1, 2x2, 2x4, 4x4"),
        ("tpu-v5-lite-device", "4x4", "spec.tpu.topology", "not offered for tpu-v5-lite-device"),
        ("tpu-v5p-slice", "2x4", "spec.tpu.topology", "2x2x1"),
        ("tpu-v6e-slice", "3x3", "spec.tpu.topology", "not offered"),
    ],
)
def test_unschedulable_slices_name_the_field(accelerator, topology, field, text):
    with pytest.raises(tpu.PlacementError) as err:
        tpu.placement(accelerator, topology)
    assert err.value.field == field
    assert text in err.value.message


def test_default_mesh_caps_tensor_parallelism():
    assert tpu.default_mesh(1) == "tp=1"
    assert tpu.default_mesh(8) == "tp=8"
    assert tpu.default_mesh(16) == "dp=2,tp=8"
    assert tpu.default_mesh(16, max_tp=4) == "dp=4,tp=4"
    with pytest.raises(ValueError):
        tpu.default_mesh(0)
