"""A small safetensors reader: memory-maps each tensor and reports damage with the file's name."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

from .errors import CheckpointError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile(Mapping[str, np.ndarray]):
    """Read-only mapping name -> array (memory-mapped, no copy until used)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", raw)
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{self.path}: truncated safetensors file (header of {header_len} bytes, file is {size})"
                )
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._data_size = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = _DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}"
                )
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
            if end > self._data_size:
                raise CheckpointError(
                    f"{self.path}: truncated safetensors file: tensor {name!r} needs bytes up to {end}, "
                    f"the data section has {self._data_size}"
                )
            if end - start != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
                raise CheckpointError(f"{self.path}: tensor {name!r} byte size does not match shape {shape}")
            self._entries[name] = (np.dtype(dtype), shape, start, end)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if self._entries else None

    def __getitem__(self, name: str) -> np.ndarray:
        dtype, shape, start, end = self._entries[name]
        buf = self._mm[self._data_start + start : self._data_start + end]
        return buf.view(dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class ShardedCheckpoint(Mapping[str, np.ndarray]):
    """All tensors of a Hugging Face directory: one file, or many listed by model.safetensors.index.json."""

    def __init__(self, directory: str | os.PathLike):
        directory = os.fspath(directory)
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors weights found")
        self._where: dict[str, SafetensorsFile] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise CheckpointError(f"{index}: lists {name}, which does not exist")
            st = SafetensorsFile(path)
            for key in st:
                self._where[key] = st

    def file_of(self, name: str) -> str:
        return self._where[name].path

    def __getitem__(self, name: str) -> np.ndarray:
        return self._where[name][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
