"""A GGUF file's header, read and checked in Python before MLX reads the file.

MLX's GGUF reader trusts the header it reads: a tensor or metadata count off by one, a key
length past the file or an alignment of 0 crashed the process (a segmentation fault, a
floating-point exception), a tensor type it does not know ended its tensor list early without
a word, and a version other than 3 was read as if it were 3. `check_gguf` walks the header as
the GGUF specification lays it out (magic, version, counts, typed metadata, tensor infos),
with every count and length bounded by the bytes left in the file, and raises `ModelError`
naming the file, what is wrong and where, before MLX opens it. It reads the header only (the
metadata arrays are skipped, not decoded): about 50 ms for the default model.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from metal_attn.checks import is_int
from metal_attn.errors import ModelError

__all__ = ["SUPPORTED_TENSOR_TYPES", "GGUFHeader", "TensorInfo", "check_gguf"]

MAGIC = b"GGUF"
#: Versions whose layout this reader (and MLX's) knows: 64-bit counts and lengths.
SUPPORTED_VERSIONS = (2, 3)
#: The default of ``general.alignment``.
DEFAULT_ALIGNMENT = 32
#: GGML's most dimensions a tensor has.
MAX_DIMS = 4

#: Metadata value types: id -> (name, struct format of a scalar or None for string/array).
_VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"), 4: ("uint32", "<I"),
    5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"), 8: ("string", None), 9: ("array", None),
    10: ("uint64", "<Q"), 11: ("int64", "<q"), 12: ("float64", "<d"),
}
_STRING, _ARRAY = 8, 9

#: Tensor types the loader serves: id -> (name, elements per block, bytes per block). MLX reads
#: Q4_0, Q4_1 and Q8_0 as affine-quantized triples (group size 32) and F32/F16 as they are; the
#: others are refused by name rather than converted or dropped.
SUPPORTED_TENSOR_TYPES: Mapping[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
}
#: Names of the other GGML types, for the refusal.
_OTHER_TENSOR_TYPES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: its name, its dimensions in GGML order (fastest first), type and data offset."""

    name: str
    dims: tuple[int, ...]
    type: int
    offset: int

    @property
    def nbytes(self) -> int:
        _, block, size = SUPPORTED_TENSOR_TYPES[self.type]
        n = 1
        for d in self.dims:
            n *= d
        return n // block * size

    @property
    def quantized(self) -> bool:
        return SUPPORTED_TENSOR_TYPES[self.type][1] > 1


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    """What the header holds: its version, the scalar and string metadata (arrays as their lengths),
    the tensors, and where their data starts."""

    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Reader:
    """Reads a file front to back; every read is checked against the bytes left."""

    def __init__(self, f: BinaryIO, size: int, where: str) -> None:
        self.f, self.size, self.where = f, size, where
        self.pos = 0

    def fail(self, what: str) -> ModelError:
        return ModelError(f"{self.where} is not a readable GGUF file: {what} (at byte {self.pos} of {self.size}; "
                          "damaged, or not a GGUF that MLX reads)")

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes, {self.size - self.pos} are left")
        data = self.f.read(n)
        if len(data) != n:
            raise self.fail(f"{what}: the file ended early")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes, {self.size - self.pos} are left")
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str, keep: bool = True) -> str | None:
        n = self.u64(f"the length of {what}")
        if not keep:
            self.skip(n, what)
            return None
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def count(self, what: str, min_item_bytes: int) -> int:
        """A count of items of at least ``min_item_bytes`` each, no more than the file could hold."""
        n = self.u64(what)
        if n * min_item_bytes > self.size - self.pos:
            raise self.fail(f"{what}={n} items of at least {min_item_bytes} bytes do not fit in the "
                            f"{self.size - self.pos} bytes left")
        return n


def _value(r: _Reader, kind: int, key: str) -> Any:
    if kind not in _VALUE_TYPES:
        raise r.fail(f"metadata {key!r} has value type {kind} (allowed: {', '.join(map(str, _VALUE_TYPES))})")
    name, fmt = _VALUE_TYPES[kind]
    if fmt is not None:
        return r.scalar(fmt, f"metadata {key!r} ({name})")
    if kind == _STRING:
        return r.string(f"metadata {key!r}")
    item = r.u32(f"the element type of metadata {key!r}")
    if item == _ARRAY:
        raise r.fail(f"metadata {key!r} is an array of arrays, which MLX does not read")
    if item not in _VALUE_TYPES:
        raise r.fail(f"metadata {key!r} is an array of value type {item}")
    item_fmt = _VALUE_TYPES[item][1]
    n = r.count(f"the length of metadata {key!r}", struct.calcsize(item_fmt) if item_fmt else 8)
    if item_fmt is not None:
        r.skip(n * struct.calcsize(item_fmt), f"metadata {key!r}")
    else:
        for i in range(n):
            r.string(f"metadata {key!r}[{i}]", keep=False)
    return _ArrayLength(n, _VALUE_TYPES[item][0])


@dataclasses.dataclass(frozen=True)
class _ArrayLength:
    """An array in the metadata, kept as its length and element type (the values are MLX's to read)."""

    length: int
    element: str


def check_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of the GGUF file at ``path``, checked; `ModelError` naming what is wrong otherwise."""
    p = Path(path)
    where = f"model={str(path)!r}"
    try:
        size = p.stat().st_size
        f = p.open("rb")
    except OSError as exc:
        raise ModelError(f"{where} could not be read ({exc.strerror or exc})") from None
    with f:
        r = _Reader(f, size, where)
        if r.take(4, "the magic") != MAGIC:
            raise r.fail("it does not start with the GGUF magic")
        version = r.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            raise r.fail(f"GGUF version {version} (allowed: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = r.count("the tensor count", 8 + 4 + 8 + 4 + 8)
        n_kv = r.count("the metadata count", 8 + 4 + 1)
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = r.string(f"metadata key {i}")
            if key in metadata:
                raise r.fail(f"metadata key {key!r} appears twice")
            metadata[key] = _value(r, r.u32(f"the value type of metadata {key!r}"), key)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not is_int(alignment) or alignment < 8 or alignment % 8 or alignment & (alignment - 1):
            raise r.fail(f"general.alignment={alignment!r} (allowed: a power of two, a multiple of 8)")
        tensors = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = r.string(f"the name of tensor {i}")
            if name in seen:
                raise r.fail(f"tensor {name!r} appears twice")
            seen.add(name)
            n_dims = r.u32(f"the dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise r.fail(f"tensor {name!r} has {n_dims} dimensions (allowed: 1 to {MAX_DIMS})")
            dims = tuple(r.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
            kind = r.u32(f"the type of tensor {name!r}")
            offset = r.u64(f"the data offset of tensor {name!r}")
            if kind not in SUPPORTED_TENSOR_TYPES:
                known = _OTHER_TENSOR_TYPES.get(kind, "unknown")
                allowed = ", ".join(v[0] for v in SUPPORTED_TENSOR_TYPES.values())
                raise r.fail(f"tensor {name!r} has type {kind} ({known}), which this loader does not read "
                             f"(allowed: {allowed})")
            if min(dims) < 1 or any(d >= 2**31 for d in dims):
                raise r.fail(f"tensor {name!r} has dimensions {list(dims)} (allowed: 1 to 2**31 - 1 each)")
            block = SUPPORTED_TENSOR_TYPES[kind][1]
            if dims[0] % block:
                raise r.fail(f"tensor {name!r} of type {SUPPORTED_TENSOR_TYPES[kind][0]} has rows of {dims[0]} "
                             f"elements (allowed: a multiple of its block of {block})")
            tensors.append(TensorInfo(name, dims, kind, offset))
        data_offset = -(-r.pos // alignment) * alignment
        data_size = size - data_offset
        for t in tensors:
            if t.offset % alignment or t.offset + t.nbytes > data_size:
                raise r.fail(f"tensor {t.name!r} ({t.nbytes} bytes at data offset {t.offset}) lies outside the "
                             f"{max(data_size, 0)} bytes of tensor data, or off its {alignment}-byte alignment")
    return GGUFHeader(version, metadata, tuple(tensors), alignment, data_offset)
