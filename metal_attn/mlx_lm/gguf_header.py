"""A GGUF file's header, read and checked in Python before MLX reads the file.

MLX's GGUF reader trusts the header it reads: a tensor or metadata count off by one, a key
length past the file or an alignment of 0 crashed the process (a segmentation fault, a
floating-point exception), a tensor type it does not know ended its tensor list early without
a word, and a version other than 3 was read as if it were 3. `check_gguf` walks the header as
the GGUF specification lays it out (magic, version, counts, typed metadata, tensor infos),
with every count and length bounded by the bytes left in the file, and raises `ModelError`
naming the file, what is wrong and where, before MLX opens it. It reads the header only (numeric
metadata arrays are skipped, string arrays checked for UTF-8): about 70 ms for the default model.

What MLX 0.32.4 misreads is refused here too: a float64 value (stored as a float32, read 4 bytes
short, so the rest of the header is out of step: a segmentation fault), a length of 2**31 or more
(read as a 32-bit int: a different header from the one checked), a ``general.alignment`` of any
type but uint32 (ignored by MLX: every tensor shifted). Lengths are capped well below that
(`MAX_ARRAY_LENGTH`, `MAX_STRING_BYTES`, `MAX_NAME_BYTES`, `MAX_HEADER_BYTES`), so the memory and
time this check takes are bounded whatever the file says, and tensors must fit in memory
(`memory_bytes`): MLX does not check its allocation and crashed on a tensor larger than memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from metal_attn.checks import is_int
from metal_attn.errors import ModelError

__all__ = ["SUPPORTED_TENSOR_TYPES", "GGUFHeader", "TensorInfo", "check_gguf", "memory_bytes"]

MAGIC = b"GGUF"
#: Versions whose layout this reader (and MLX's) knows: 64-bit counts and lengths.
SUPPORTED_VERSIONS = (2, 3)
#: The default of ``general.alignment``.
DEFAULT_ALIGNMENT = 32
#: GGML's most dimensions a tensor has.
MAX_DIMS = 4
#: Most elements of a metadata array (a vocabulary is about 2**18; MLX reads lengths as 32-bit ints).
MAX_ARRAY_LENGTH = 2**24
#: Most elements of a metadata array of strings (each is a Python object, in this check and in MLX).
MAX_STRING_ARRAY_LENGTH = 2**21
#: Most bytes of a metadata string (a chat template is a few KB).
MAX_STRING_BYTES = 4 << 20
#: Most bytes of a metadata key or a tensor name (GGML's tensor names are at most 64).
MAX_NAME_BYTES = 4096
#: Most tensors and most metadata entries.
MAX_COUNT = 2**16
#: Most bytes of the whole header (metadata and tensor infos); a large vocabulary takes tens of MB.
MAX_HEADER_BYTES = 512 << 20
#: The metadata type MLX 0.32.4 misreads (stores a float32, advances 4 bytes instead of 8).
_FLOAT64 = 12
_UINT32 = 4

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

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        """A UTF-8 string of at most ``limit`` bytes (its length is checked before it is read)."""
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise self.fail(f"{what} is {n} bytes long (allowed: at most {limit})")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def count(self, what: str, min_item_bytes: int, limit: int) -> int:
        """A count of at most ``limit`` items of at least ``min_item_bytes`` each, no more than the file could hold."""
        n = self.u64(what)
        if n > limit:
            raise self.fail(f"{what}={n} (allowed: at most {limit})")
        if n * min_item_bytes > self.size - self.pos:
            raise self.fail(f"{what}={n} items of at least {min_item_bytes} bytes do not fit in the "
                            f"{self.size - self.pos} bytes left")
        return n


def _check_type(r: _Reader, kind: int, key: str, element: bool) -> None:
    """A metadata value (or array element) type MLX reads right: known, and not float64."""
    allowed = ", ".join(f"{k} ({v[0]})" for k, v in _VALUE_TYPES.items() if k != _FLOAT64)
    if kind == _FLOAT64:
        raise r.fail(f"metadata {key!r} is {'an array of ' if element else ''}float64 (type 12), which MLX 0.32.4 "
                     f"misreads (as a float32, 4 bytes short: the rest of the header out of step); allowed: {allowed}")
    if kind not in _VALUE_TYPES:
        raise r.fail(f"metadata {key!r} {'is an array of' if element else 'has'} value type {kind} "
                     f"(allowed: {allowed})")


def _value(r: _Reader, kind: int, key: str) -> Any:
    _check_type(r, kind, key, element=False)
    name, fmt = _VALUE_TYPES[kind]
    if fmt is not None:
        return r.scalar(fmt, f"metadata {key!r} ({name})")
    if kind == _STRING:
        return r.string(f"metadata {key!r}")
    item = r.u32(f"the element type of metadata {key!r}")
    if item == _ARRAY:
        raise r.fail(f"metadata {key!r} is an array of arrays, which MLX does not read")
    _check_type(r, item, key, element=True)
    item_fmt = _VALUE_TYPES[item][1]
    n = r.count(f"the length of metadata {key!r}", struct.calcsize(item_fmt) if item_fmt else 8,
                MAX_ARRAY_LENGTH if item_fmt else MAX_STRING_ARRAY_LENGTH)
    if item_fmt is not None:
        r.skip(n * struct.calcsize(item_fmt), f"metadata {key!r}")
    else:
        for i in range(n):
            r.string(f"metadata {key!r}[{i}]")
            if r.pos > MAX_HEADER_BYTES:
                break  # refused by the caller, with the header's size
    return _ArrayLength(n, _VALUE_TYPES[item][0])


@dataclasses.dataclass(frozen=True)
class _ArrayLength:
    """An array in the metadata, kept as its length and element type (the values are MLX's to read)."""

    length: int
    element: str


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes (the bound on the tensors' bytes), or None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def _open_regular(path: Path, where: str) -> tuple[BinaryIO, int]:
    """``path`` opened for reading (without blocking: a FIFO would wait for a writer) and its size;
    `ModelError` when it cannot be opened or is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ModelError(f"{where} could not be read ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ModelError(f"{where} is not a regular file (allowed: a GGUF file)")
    return os.fdopen(fd, "rb"), st.st_size


def _check_tensor_bytes(r: _Reader, tensors: list[TensorInfo], data_size: int, alignment: int) -> None:
    """Each tensor within the data, aligned, apart from the others, and all of them within memory."""
    memory = memory_bytes()
    total = 0
    for t in tensors:
        if t.offset % alignment or t.offset + t.nbytes > data_size:
            raise r.fail(f"tensor {t.name!r} ({t.nbytes} bytes at data offset {t.offset}) lies outside the "
                         f"{max(data_size, 0)} bytes of tensor data, or off its {alignment}-byte alignment")
        total += t.nbytes
        if memory is not None and total > memory:
            what = f"tensor {t.name!r} is {t.nbytes} bytes" if t.nbytes > memory else \
                f"the tensors take {total} bytes or more"
            raise r.fail(f"{what}, more than this machine's {memory} bytes of memory (allowed: a model that fits; "
                         "MLX does not check the allocation)")
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in itertools.pairwise(ordered):
        if a.offset + a.nbytes > b.offset:
            raise r.fail(f"tensors {a.name!r} (bytes {a.offset} to {a.offset + a.nbytes}) and {b.name!r} (from "
                         f"{b.offset}) overlap (allowed: each tensor its own bytes)")


def check_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of the GGUF file at ``path``, checked; `ModelError` naming what is wrong otherwise."""
    p = Path(path)
    where = f"model={str(path)!r}"
    f, size = _open_regular(p, where)
    with f:
        r = _Reader(f, size, where)
        if r.take(4, "the magic") != MAGIC:
            raise r.fail("it does not start with the GGUF magic")
        version = r.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            raise r.fail(f"GGUF version {version} (allowed: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = r.count("the tensor count", 8 + 4 + 8 + 4 + 8, MAX_COUNT)
        n_kv = r.count("the metadata count", 8 + 4 + 1, MAX_COUNT)
        metadata: dict[str, Any] = {}
        kinds: dict[str, int] = {}
        for i in range(n_kv):
            key = r.string(f"metadata key {i}", MAX_NAME_BYTES)
            if key in metadata:
                raise r.fail(f"metadata key {key!r} appears twice")
            kinds[key] = r.u32(f"the value type of metadata {key!r}")
            metadata[key] = _value(r, kinds[key], key)
            if r.pos > MAX_HEADER_BYTES:
                raise r.fail(f"the metadata reaches past {MAX_HEADER_BYTES} bytes (allowed: a header of at most "
                             f"{MAX_HEADER_BYTES} bytes)")
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in kinds and kinds["general.alignment"] != _UINT32:
            raise r.fail(f"general.alignment={alignment!r} is stored as {_VALUE_TYPES[kinds['general.alignment']][0]} "
                         "(allowed: uint32, as the GGUF specification types it; MLX ignores any other type and "
                         f"aligns to {DEFAULT_ALIGNMENT})")
        if not is_int(alignment) or alignment < 8 or alignment % 8 or alignment & (alignment - 1):
            raise r.fail(f"general.alignment={alignment!r} (allowed: a power of two, a multiple of 8)")
        tensors = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = r.string(f"the name of tensor {i}", MAX_NAME_BYTES)
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
        if r.pos > MAX_HEADER_BYTES:
            raise r.fail(f"the header reaches past {MAX_HEADER_BYTES} bytes (allowed: at most {MAX_HEADER_BYTES})")
        data_offset = -(-r.pos // alignment) * alignment
        _check_tensor_bytes(r, tensors, size - data_offset, alignment)
    return GGUFHeader(version, metadata, tuple(tensors), alignment, data_offset)
