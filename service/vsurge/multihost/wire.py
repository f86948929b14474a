"""The step lane's values as bytes: a small, explicit, versioned encoding that runs no code to decode.

What crosses the lane is a tree of plain values: None, bools, integers, floats, strings, bytes, lists,
tuples, dicts, numpy arrays and scalars of a fixed set of dtypes, the engine's own records (NamedTuples and
dataclasses allowed by ``register``), and device arrays as *handles* (result leaf ``i`` of call ``n``, the
same global array on every process) or as host values with their PartitionSpec. Each value is one tag
byte and a fixed layout (big-endian lengths, raw C-order array buffers). Decoding reads bounds-checked
fields and builds only those types: a record is rebuilt from its fields by name, never by a reference to
code, so a frame can at worst be refused. Anything malformed raises ``WireError``.

``encode(value, device_array)``: ``device_array(x)`` turns a device array into ``Handle`` or ``HostValue``
(the leader's lane knows which); ``decode(data, handle, host_value)`` turns them back into arrays.
"""

from __future__ import annotations

import dataclasses
import struct
import types
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

VERSION = 1  # of this format and the frames that carry it (channel.py): a change to either bumps it
MAX_DEPTH = 32

# tags
_NONE, _FALSE, _TRUE, _INT, _BIGINT, _FLOAT, _STR, _BYTES = range(8)
_LIST, _TUPLE, _DICT, _ARRAY, _SCALAR, _HANDLE, _HOSTVALUE, _RECORD = range(8, 16)

DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d)
    for d in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        ml_dtypes.bfloat16,
    )
)
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}

_U8, _U32, _U64, _I64, _F64 = (struct.Struct(f) for f in ("!B", "!I", "!Q", "!q", "!d"))


class WireError(ValueError):
    """A value that cannot be encoded, or bytes that do not decode to one: a protocol error."""


class Handle(NamedTuple):
    """Result leaf ``leaf`` of lane call ``call``: the same global array on every process."""

    call: int
    leaf: int


class HostValue(NamedTuple):
    """A device array sent by value (one the leader's driver made itself): its host copy and how it is
    sharded over the mesh (``spec`` None: one device)."""

    value: np.ndarray
    spec: tuple | None


class Dropped:
    """What a callback in a call's arguments becomes (a progress printer): None on the other side."""


# ------------------------------------------------------------------------------------ the records

_RECORDS: dict[str, type] = {}
_NAMES: dict[type, str] = {}


def register(cls: type, name: str | None = None) -> type:
    """Allow ``cls`` (a NamedTuple or a dataclass) on the lane under ``name`` (default: its own)."""
    name = name or cls.__name__
    if not (_is_namedtuple(cls) or dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is neither a NamedTuple nor a dataclass")
    _RECORDS[name] = cls
    _NAMES[cls] = name
    raw = name.encode()
    _HEADERS[cls] = _B.pack(_RECORD) + _U8.pack(len(raw)) + raw
    _ENCODERS[cls] = _namedtuple if _is_namedtuple(cls) else _dataclass
    return cls


def _is_namedtuple(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


# Fields a record never sends (the workers do not need them), with what they become there.
_SKIPPED = {"SamplingParams": {"grammar"}}


def _is_callback(obj: Any) -> bool:
    if isinstance(obj, types.FunctionType):
        return True
    return isinstance(obj, types.MethodType | types.BuiltinMethodType | partial)


# ------------------------------------------------------------------------------------ encode

_B = struct.Struct("!B")
_BQ = struct.Struct("!Bq")
_BD = struct.Struct("!Bd")
_BI = struct.Struct("!BI")
_BQI = struct.Struct("!BQI")
_BB = struct.Struct("!BB")


def encode(value: Any, device_array: Callable[[Any], Handle | HostValue]) -> bytes:
    """``value`` as bytes; ``device_array(x)`` says how each device array crosses (a handle or a value)."""
    enc = _Encoder(device_array)
    enc.value(value, 0)
    return b"".join(enc.out)


class _Encoder:
    __slots__ = ("out", "dev")

    def __init__(self, dev: Callable[[Any], Handle | HostValue]):
        self.out: list[bytes] = []
        self.dev = dev

    def value(self, v: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise WireError("value nested too deeply for the lane")
        fn = _ENCODERS.get(type(v))
        if fn is None:
            fn = _encoder_for(v)
        fn(self, v, depth)

    def array(self, a: np.ndarray) -> None:
        code = _DTYPE_CODE.get(a.dtype)
        if code is None:
            raise WireError(f"arrays of dtype {a.dtype} do not cross the lane")
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        data = a.tobytes()
        self.out.append(
            _BB.pack(code, a.ndim) + b"".join(_U64.pack(n) for n in a.shape) + _U64.pack(len(data))
        )
        self.out.append(data)


def _none(e: _Encoder, v: Any, depth: int) -> None:
    e.out.append(b"\x00")


def _bool(e: _Encoder, v: bool, depth: int) -> None:
    e.out.append(b"\x02" if v else b"\x01")


def _int(e: _Encoder, v: int, depth: int) -> None:
    if -(2**63) <= v < 2**63:
        e.out.append(_BQ.pack(_INT, v))
    else:
        raw = v.to_bytes((v.bit_length() + 8) // 8, "big", signed=True)
        e.out.append(_BI.pack(_BIGINT, len(raw)) + raw)


def _float(e: _Encoder, v: float, depth: int) -> None:
    e.out.append(_BD.pack(_FLOAT, v))


def _str(e: _Encoder, v: str, depth: int) -> None:
    raw = v.encode()
    e.out.append(_BI.pack(_STR, len(raw)) + raw)


def _bytes(e: _Encoder, v: bytes, depth: int) -> None:
    e.out.append(_BI.pack(_BYTES, len(v)) + v)


def _seq(tag: int) -> Callable:
    def enc(e: _Encoder, v: Any, depth: int) -> None:
        e.out.append(_BI.pack(tag, len(v)))
        for x in v:
            e.value(x, depth + 1)

    return enc


def _dict(e: _Encoder, v: dict, depth: int) -> None:
    e.out.append(_BI.pack(_DICT, len(v)))
    for k, x in v.items():
        e.value(k, depth + 1)
        e.value(x, depth + 1)


def _ndarray(e: _Encoder, v: np.ndarray, depth: int) -> None:
    e.out.append(b"\x0b")
    e.array(v)


def _scalar(e: _Encoder, v: np.generic, depth: int) -> None:
    e.out.append(b"\x0c")
    e.array(np.asarray(v))


def _device(e: _Encoder, v: Any, depth: int) -> None:
    ref = e.dev(v)
    if isinstance(ref, Handle):
        e.out.append(_BQI.pack(_HANDLE, ref.call, ref.leaf))
    else:
        e.out.append(b"\x0e")
        e.array(np.asarray(ref.value))
        e.value(ref.spec, depth + 1)


def _namedtuple(e: _Encoder, v: tuple, depth: int) -> None:
    e.out.append(_HEADERS[type(v)] + _U32.pack(len(v)))
    for x in v:
        e.value(x, depth + 1)


def _dataclass(e: _Encoder, v: Any, depth: int) -> None:
    fields = dataclasses.fields(v)
    skipped = _SKIPPED.get(_NAMES[type(v)], ())
    e.out.append(_HEADERS[type(v)] + _U32.pack(len(fields)))
    for f in fields:
        x = getattr(v, f.name)
        e.value(f.name, depth + 1)
        # a skipped field says only whether it was set (a grammar: the masks cross, not the grammar)
        e.value((x is not None) if f.name in skipped else x, depth + 1)


_ENCODERS: dict[type, Callable] = {
    type(None): _none,
    Dropped: _none,
    bool: _bool,
    int: _int,
    float: _float,
    str: _str,
    bytes: _bytes,
    list: _seq(_LIST),
    tuple: _seq(_TUPLE),
    dict: _dict,
    np.ndarray: _ndarray,
}
_HEADERS: dict[type, bytes] = {}


def _encoder_for(v: Any) -> Callable:
    """The encoder of a type met for the first time (numpy scalars, jax's array types, callbacks)."""
    cls = type(v)
    if isinstance(v, np.generic):
        fn = _scalar
    elif isinstance(v, jax.Array):
        fn = _device
    elif _is_callback(v):
        fn = _none  # progress callbacks: the workers' own logs say enough
    else:
        raise WireError(f"{cls.__module__}.{cls.__qualname__} does not cross the lane")
    _ENCODERS[cls] = fn
    return fn


# ------------------------------------------------------------------------------------ decode


def decode(data: bytes, handle: Callable[[Handle], Any], host_value: Callable[[HostValue], Any]) -> Any:
    """The value ``data`` encodes; ``handle`` and ``host_value`` turn device arrays back into arrays.
    WireError for anything that is not exactly one well-formed value."""
    d = _Decoder(bytes(data), handle, host_value)
    try:
        v = d.value(0)
    except (struct.error, UnicodeDecodeError, OverflowError, IndexError) as e:
        raise WireError(f"malformed value: {e}") from None
    if d.at != len(d.data):
        raise WireError("trailing bytes after the value")
    return v


class _Decoder:
    __slots__ = ("data", "at", "handle", "host_value")

    def __init__(self, data: bytes, handle: Callable, host_value: Callable):
        self.data, self.at = data, 0
        self.handle, self.host_value = handle, host_value

    def unpack(self, s: struct.Struct) -> Any:
        v = s.unpack_from(self.data, self.at)  # struct.error past the end: a malformed value
        self.at += s.size
        return v[0] if len(v) == 1 else v

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise WireError("truncated value")
        self.at += n
        return self.data[self.at - n : self.at]

    def count(self) -> int:
        n = self.unpack(_U32)
        if n > len(self.data) - self.at:  # every element takes a byte at least
            raise WireError("a length beyond the frame")
        return n

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError("value nested too deeply")
        tag = self.data[self.at]  # IndexError past the end: a malformed value
        self.at += 1
        if tag == _HANDLE:  # the common case: most of a call's leaves are arrays of earlier calls
            call, leaf = _U64_U32.unpack_from(self.data, self.at)
            self.at += 12
            return self.handle(Handle(call, leaf))
        if tag >= len(_DECODERS):
            raise WireError(f"unknown tag {tag}")
        return _DECODERS[tag](self, depth)

    def array(self) -> np.ndarray:
        code, ndim = self.unpack(_BB)
        if code >= len(DTYPES):
            raise WireError(f"unknown dtype code {code}")
        shape = tuple(self.unpack(_U64) for _ in range(ndim))
        dtype = DTYPES[code]
        size = int(np.prod(shape, dtype=object)) * dtype.itemsize
        n = self.unpack(_U64)
        if n != size:
            raise WireError(f"array of shape {shape} {dtype} with {n} bytes")
        if self.at + n > len(self.data):
            raise WireError("truncated value")
        start, self.at = self.at, self.at + n
        if not n:
            return np.zeros(shape, dtype)
        return np.frombuffer(self.data, dtype, n // dtype.itemsize, start).reshape(shape).copy()


def _d_bigint(d: _Decoder, depth: int) -> int:
    n = d.count()
    if n > 64:
        raise WireError("integer too large")
    return int.from_bytes(d.take(n), "big", signed=True)


def _d_seq(d: _Decoder, depth: int) -> list:
    return [d.value(depth + 1) for _ in range(d.count())]


def _d_dict(d: _Decoder, depth: int) -> dict:
    out = {}
    for _ in range(d.count()):
        k = d.value(depth + 1)
        if not isinstance(k, int | str | float | bool | None):
            raise WireError(f"a dict key of type {type(k).__name__}")
        out[k] = d.value(depth + 1)
    return out


def _d_scalar(d: _Decoder, depth: int) -> np.generic:
    a = d.array()
    if a.ndim:
        raise WireError("a scalar with a shape")
    return a[()]


def _d_host_value(d: _Decoder, depth: int) -> Any:
    value = d.array()
    spec = d.value(depth + 1)
    if spec is not None and not _is_spec(spec):
        raise WireError(f"not a partition spec: {spec!r}")
    return d.host_value(HostValue(value, spec))


def _is_spec(spec: Any) -> bool:
    def axis(a: Any) -> bool:
        return (
            a is None or isinstance(a, str) or (isinstance(a, tuple) and all(isinstance(x, str) for x in a))
        )

    return isinstance(spec, tuple) and all(axis(a) for a in spec)


def _d_record(d: _Decoder, depth: int) -> Any:
    name = str(d.take(d.unpack(_U8)), "utf-8")
    cls = _RECORDS.get(name)
    if cls is None:
        raise WireError(f"unknown record {name!r}")
    n = d.count()
    if _is_namedtuple(cls):
        if n != len(cls._fields):
            raise WireError(f"record {name}: {n} fields, expected {len(cls._fields)}")
        return cls._make([d.value(depth + 1) for _ in range(n)])
    fields = {}
    for _ in range(n):
        k = d.value(depth + 1)
        if not isinstance(k, str):
            raise WireError(f"record {name}: a field name of type {type(k).__name__}")
        fields[k] = d.value(depth + 1)
    known = {f.name for f in dataclasses.fields(cls)}
    if not set(fields) <= known:
        raise WireError(f"record {name}: unknown fields {sorted(set(fields) - known)}")
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise WireError(f"record {name}: {e}") from None


_U64_U32 = struct.Struct("!QI")
_DECODERS: list[Callable[[_Decoder, int], Any] | None] = [
    lambda d, depth: None,  # _NONE
    lambda d, depth: False,  # _FALSE
    lambda d, depth: True,  # _TRUE
    lambda d, depth: d.unpack(_I64),  # _INT
    _d_bigint,
    lambda d, depth: d.unpack(_F64),  # _FLOAT
    lambda d, depth: str(d.take(d.count()), "utf-8"),  # _STR
    lambda d, depth: d.take(d.count()),  # _BYTES
    _d_seq,  # _LIST
    lambda d, depth: tuple(_d_seq(d, depth)),  # _TUPLE
    _d_dict,
    lambda d, depth: d.array(),  # _ARRAY
    _d_scalar,
    None,  # _HANDLE: Decoder.value
    _d_host_value,
    _d_record,
]
