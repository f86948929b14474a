"""The GGUF file format, read with bounds checks: the header, the metadata and the tensor table.

`read_gguf_metadata(path, decode=keys)` reads the metadata alone, with the long string arrays named in
`decode` (the vocabulary, the merges) read whole. `_parse(path)` reads the whole header into `_Tensor`s whose
data are views into the memory-mapped file; `_Metadata` reads typed values out of the metadata. A short or
corrupt file raises `CheckpointError` naming the file and where it ends.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vsurge.models.errors import CheckpointError

__all__ = ["StringArray", "read_gguf_metadata"]


# --------------------------------------------------------------------------------------------------
# The file format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
# magic "GGUF", version u32, tensor count u64, metadata count u64, metadata (key, type, value)*,
# tensor table (name, n_dims u32, dims u64*, ggml type u32, offset u64)*, padding to the alignment, data.
# Everything little-endian. Parsed here with bounds checks, so a short file says where it ends.

_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY_TYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
_MAX_DIMS = 4
_DECODED_STRING_ARRAY = 4096  # longer string arrays (the vocabulary, merges) are kept as a count only


@dataclass(frozen=True)
class StringArray:
    """A long string array of the metadata (e.g. tokenizer.ggml.tokens), kept as its length only."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class _Tensor:
    name: str
    type_id: int
    type_name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous (row) dimension
    data: np.ndarray | None  # a view into the memory map; None for types we do not read

    @property
    def shape(self) -> tuple[int, ...]:  # numpy / Hugging Face order
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


@dataclass
class _Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[_Tensor]


class _Cursor:
    def __init__(self, path: Path, buf: Any, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0
        self.decode_whole = False  # read long string arrays whole instead of as a StringArray count

    def truncated(self, what: str, need: int) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: file is truncated: {what} needs bytes up to offset {need}, the file has {self.size}"
        )

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise self.truncated(what, start + n)
        self.pos = start + n
        return start

    def scalar(self, type_id: int, what: str) -> Any:
        fmt = _SCALAR_FORMATS[type_id]
        value = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]
        if type_id == _FLOAT32:  # the shortest decimal that is this float32: 1e-05, not 9.99999974e-06
            value = float(str(np.float32(value)))
        return value

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self.take(n, what)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: {what} at offset {start} is not valid UTF-8") from exc

    def strings(self, count: int, what: str) -> list[str]:
        if count > self.size - self.pos:  # each string takes at least its 8-byte length
            raise self.truncated(what, self.pos + count)
        return [self.string(what) for _ in range(count)]

    def value(self, type_id: int, what: str) -> Any:
        if type_id in _SCALAR_FORMATS:
            return self.scalar(type_id, what)
        if type_id == _STRING:
            return self.string(what)
        if type_id != _ARRAY:
            raise CheckpointError(f"{self.path}: {what} has unknown GGUF value type {type_id}")
        item_type, count = self.u32(what), self.u64(what)
        if item_type in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[item_type])
            start = self.take(count * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).copy()
        if item_type == _STRING:
            if self.decode_whole:
                return self.strings(count, what)
            if count > _DECODED_STRING_ARRAY:
                for _ in range(count):  # skip, checking each length against the file
                    self.take(self.u64(what), what)
                return StringArray(count)
            return [self.string(what) for _ in range(count)]
        if item_type == _ARRAY:
            if count > self.size - self.pos:  # each element takes at least one byte
                raise self.truncated(what, self.pos + count)
            return [self.value(_ARRAY, what) for _ in range(count)]
        raise CheckpointError(f"{self.path}: {what} is an array of unknown GGUF value type {item_type}")


def read_gguf_metadata(path: str | os.PathLike, *, decode: Container[str] = ()) -> dict[str, Any]:
    """The metadata of a GGUF file (its tensor table is not read), with the string arrays named in `decode`
    read whole; other long string arrays are `StringArray` counts, numeric arrays numpy arrays."""
    path = Path(path)
    cur = _open(path)
    try:
        return _read_metadata(cur, decode)[2]
    finally:
        cur.buf.close()


def _open(path: Path) -> _Cursor:
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after the file is closed
    return _Cursor(path, buf, size)


def _read_metadata(cur: _Cursor, decode: Container[str] = ()) -> tuple[int, int, dict[str, Any]]:
    """(version, tensor count, metadata), leaving the cursor at the tensor table."""
    path, size = cur.path, cur.size
    cur.take(4, "magic")
    version = cur.u32("the version")
    if version & 0xFFFF == 0 and version != 0:
        raise CheckpointError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    if n_tensors > size or n_kv > size:
        raise CheckpointError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        type_id = cur.u32(f"metadata {key!r}")
        if key in metadata:
            raise CheckpointError(f"{path}: duplicate metadata key {key!r}")
        cur.decode_whole = key in decode
        try:
            metadata[key] = cur.value(type_id, f"metadata {key!r}")
        finally:
            cur.decode_whole = False
    return version, n_tensors, metadata


def _parse(path: Path) -> _Header:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _open(path)
    buf, size = cur.buf, cur.size
    version, n_tensors, metadata = _read_metadata(cur)

    table = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i} name")
        n_dims = cur.u32(f"tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dimensions; corrupt tensor table")
        dims = tuple(cur.u64(f"tensor {name!r}") for _ in range(n_dims))
        type_id = cur.u32(f"tensor {name!r}")
        offset = cur.u64(f"tensor {name!r}")
        table.append((name, dims, type_id, offset))

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: invalid general.alignment {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: list[_Tensor] = []
    seen: set[str] = set()
    for name, dims, type_id, offset in table:
        if name in seen:
            raise CheckpointError(f"{path}: duplicate tensor {name!r}")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            tensors.append(_Tensor(name, type_id, f"unknown type id {type_id}", dims, None))
            continue
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise CheckpointError(
                f"{path}: tensor {name!r} has rows of {dims[0]} values, not a multiple of the "
                f"{qtype.name} block of {block}"
            )
        n_bytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise cur.truncated(
                f"tensor {name!r} ({qtype.name}, shape {list(reversed(dims))})", start + n_bytes
            )
        if qtype.name == "F32":
            data = np.frombuffer(buf, np.float32, math.prod(dims), start)
        elif qtype.name == "F16":
            data = np.frombuffer(buf, np.float16, math.prod(dims), start)
        else:  # block types (BF16 too): rows of bytes, as gguf.quants.dequantize takes them
            data = np.frombuffer(buf, np.uint8, n_bytes, start)
            dims_bytes = (dims[0] // block * type_size, *dims[1:])
            data = data.reshape(tuple(reversed(dims_bytes)))
        if qtype.name in ("F32", "F16"):
            data = data.reshape(tuple(reversed(dims)))
        tensors.append(_Tensor(name, type_id, qtype.name, dims, data))
    return _Header(version, metadata, tensors)


class _Metadata:
    def __init__(self, path: Path, values: dict[str, Any]):
        self.path = path
        self.values = values

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key, default)
        if isinstance(value, np.ndarray):
            return value.tolist()
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: missing required GGUF metadata key {key!r}")
        return value

    def int(self, key: str, default: int | None = None, *, required: bool = False) -> int | None:
        value = self.require(key) if required else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, list):  # per-layer values (e.g. head counts): must all agree here
            if not value or any(v != value[0] for v in value):
                raise CheckpointError(
                    f"{self.path}: GGUF metadata {key!r} varies per layer ({value}); not supported"
                )
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} should be an integer, got {value!r}")
        return int(value)

    def float(self, key: str, default: float | None = None, *, required: bool = False) -> float | None:
        value = self.require(key) if required else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} should be a number, got {value!r}")
        return float(value)

    def array_len(self, key: str) -> int | None:
        value = self.values.get(key)
        return None if value is None or isinstance(value, str | int | float) else len(value)

    def scalars(self) -> dict[str, Any]:
        return {k: v for k, v in self.values.items() if isinstance(v, str | int | float | bool)}
