"""Lower programs for a TPU on a machine without one: the Mosaic kernels included, for CI.

`jax.export` lowers for any platform (``platforms=("tpu",)``), but a Pallas TPU kernel asks, while
lowering, which chip it is for: jax's Mosaic lowering calls ``tpu_info.get_device_kind()``, which answers
from the *abstract mesh in context* when that mesh carries an `AbstractDevice`, and only otherwise from
the local default device (a CPU here, which it refuses). So a program lowers for a TPU anywhere inside
``jax.sharding.use_abstract_mesh(AbstractMesh(..., abstract_device=AbstractDevice("TPU v5 lite", ...)))``
as long as two more things hold, both kept by models/pallas_sharded.py:

* the kernel is given its block sizes (JAX's own lookup, ``get_tuned_block_sizes``, reads
  ``jax.devices()`` and raises off TPU); they come from models/kernel_tables.py for the chip in context;
* every ``shard_map`` runs over the abstract mesh in context (jax refuses a concrete mesh that differs
  from the context's), which `pallas_sharded._shard_mesh` picks when its axes match the engine's.

`lower_for_tpu` takes any jitted function and abstract arguments (``jax.ShapeDtypeStruct``, with
shardings on a concrete mesh of this machine's devices, moved onto the abstract mesh by `on_target`, or on
the abstract mesh) and returns the ``jax.export.Exported``; `mosaic_kernels` lists the Mosaic calls in it. `targeting` is the context alone,
e.g. to build an engine as it is built on that chip (`pallas_sharded.configure` decides for the TPU in
context: the kernel path, its padded cache layout).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, Mesh, NamedSharding

from .kernel_tables import resolve_generation
from .sharding import AXES, parse_mesh_spec

_MOSAIC = re.compile(r'stablehlo\.custom_call @tpu_custom_call|custom_call_target\s*=\s*"tpu_custom_call"')
_KERNEL_NAME = re.compile(r'kernel_name\s*=\s*"([^"]+)"')


def abstract_device(generation: str = "v5e") -> AbstractDevice:
    """The TPU (by generation, ``v5e``, or device kind, ``TPU v5 lite``) as jax's lowering sees one."""
    g = resolve_generation(generation)
    return AbstractDevice(device_kind=g.device_kinds[0], num_cores=g.num_cores, platform="tpu")


def _axis_sizes(mesh: Mesh | AbstractMesh | Mapping[str, int] | str | None) -> tuple[tuple[int, ...], tuple]:
    if mesh is None or isinstance(mesh, (str, Mapping)):
        sizes = parse_mesh_spec(mesh) if not isinstance(mesh, Mapping) else {**parse_mesh_spec(None), **mesh}
        return tuple(sizes[a] for a in AXES), AXES
    return tuple(mesh.axis_sizes), tuple(mesh.axis_names)


def abstract_tpu_mesh(
    generation: str = "v5e", mesh: Mesh | AbstractMesh | Mapping[str, int] | str | None = None
) -> AbstractMesh:
    """An abstract mesh of TPUs of ``generation`` with the axes of ``mesh`` (a Mesh, an AbstractMesh,
    ``{"dp": 2, "tp": 4}`` or ``"dp=2,tp=4"``; None: one chip, dp=1 x tp=1)."""
    sizes, names = _axis_sizes(mesh)
    return AbstractMesh(sizes, names, abstract_device=abstract_device(generation))


@contextlib.contextmanager
def targeting(
    generation: str = "v5e", mesh: Mesh | AbstractMesh | Mapping[str, int] | str | None = None
) -> Iterator[AbstractMesh]:
    """Trace and lower as for TPUs of ``generation`` on ``mesh``'s axes (see the module docstring)."""
    target = abstract_tpu_mesh(generation, mesh)
    with jax.sharding.use_abstract_mesh(target):
        yield target


def lower_for_tpu(
    fn: Callable,
    *args: Any,
    generation: str = "v5e",
    mesh: Mesh | AbstractMesh | Mapping[str, int] | str | None = None,
    **kwargs: Any,
) -> jax.export.Exported:
    """``jax.export`` of ``fn`` (jitted here if it is not) at ``args`` for TPUs of ``generation`` on
    ``mesh``'s axes (default: one chip), on whatever this machine is. Raises what the lowering raises:
    a kernel that cannot lower for that chip fails here, as it would at a TPU's start."""
    jitted = fn if hasattr(fn, "trace") and hasattr(fn, "lower") else jax.jit(fn)
    with targeting(generation, mesh) as target:
        args, kwargs = on_target((args, kwargs), target)
        return jax.export.export(jitted, platforms=("tpu",))(*args, **kwargs)


def on_target(tree: Any, target: AbstractMesh) -> Any:
    """Abstract arguments whose shardings are on a mesh of this machine's devices moved onto ``target``
    (the same axes and specs): every value of the trace then carries the TPU mesh, as on the pod (jax
    refuses an op whose inputs carry two meshes: random.fold_in of a key argument with a step counter
    made in the program, for one)."""

    def one(x: Any) -> Any:
        sh = getattr(x, "sharding", None)
        if not isinstance(x, jax.ShapeDtypeStruct) or not isinstance(sh, NamedSharding):
            return x
        if not isinstance(sh.mesh, Mesh) or sh.mesh.shape_tuple != target.shape_tuple:
            return x
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(target, sh.spec), weak_type=x.weak_type
        )

    return jax.tree.map(one, tree)


def mosaic_kernels(exported: jax.export.Exported | str) -> list[str]:
    """The Mosaic (Pallas TPU) kernels in an exported module (or its text), by kernel name: one entry per
    custom call in the text (a jitted kernel called by every layer is one private function, one entry)."""
    text = exported if isinstance(exported, str) else exported.mlir_module()
    names = []
    for line in text.splitlines():
        if _MOSAIC.search(line):
            found = _KERNEL_NAME.search(line)
            names.append(found.group(1) if found else "tpu_custom_call")
    return names
