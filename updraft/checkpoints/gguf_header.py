"""A GGUF file read with every count, length and offset checked against the file's size.

gguf-py's ``GGUFReader`` believes what a header says: a string length or element count
past the end of the file makes it slice short arrays and fail later with an
``IndexError`` or a reshape error from numpy, and a tensor count of 2^60 sends it round a
loop of that length. It is also slow on a large vocabulary (a numpy view per token:
about 9 s for Llama 3's 128,256). Here the header is read from a memory map with
``struct``, nothing is allocated in proportion to what it claims, and the first claim the
file cannot hold is refused in one line that names the file and the field: a wrong
magic, a truncated header, a count or length past the end, an unknown value or tensor
type, a repeated key or tensor name, a tensor whose data runs past the end of the file or
shares bytes with another's.
``read_gguf`` gives the metadata's values and each tensor as a read-only numpy view of
the file's map, shaped as ``GGUFReader`` shapes it (gguf-py's own sizes and shapes).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# GGUF value types: the fixed-size ones' byte counts; 8 is a string, 9 an array.
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
# The fewest bytes one metadata pair (key length, an empty key, type, a 1-byte value)
# and one tensor description (name length, no dims, type, offset) can take.
MIN_PAIR_BYTES = 8 + 4 + 1
MIN_TENSOR_BYTES = 8 + 4 + 4 + 8
MAX_NESTING = 4  # arrays of arrays: deeper than any file writes


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it: dims in ggml's order (the row width
    first), its ggml type code, and where its bytes lie in the file."""

    name: str
    dims: tuple[int, ...]
    type_code: int
    start: int
    n_bytes: int


@dataclass(frozen=True)
class Header:
    version: int
    alignment: int
    data_start: int
    tensors: tuple[TensorInfo, ...]
    fields: dict[str, Any]  # the metadata's values: numbers, strings, lists of them


class _Cursor:
    """Reads little-endian values from the map, refusing any read past its end."""

    def __init__(self, path: Path, data: mmap.mmap | bytes) -> None:
        self.path = path
        self.data = data
        self.size = len(data)
        self.at = 0

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def skip(self, count: int, field: str) -> int:
        if count > self.size - self.at:
            raise self.fail(
                f"{field} runs past the end of the file ({count} bytes at offset {self.at}, "
                f"the file has {self.size}): it is truncated or corrupt"
            )
        start = self.at
        self.at += count
        return start

    def unpack(self, fmt: str, field: str) -> int:
        start = self.skip(struct.calcsize(fmt), field)
        return struct.unpack_from(fmt, self.data, start)[0]

    def count(self, field: str, each: int) -> int:
        """A uint64 count of items of at least ``each`` bytes, refused when they could
        not fit in the rest of the file."""
        value = self.unpack("<Q", field)
        if value * each > self.size - self.at:
            raise self.fail(
                f"{field} {value} cannot fit in the file: that many take at least "
                f"{value * each} bytes, {self.size - self.at} are left"
            )
        return value

    def string(self, field: str) -> str:
        length = self.unpack("<Q", f"{field}'s length")
        start = self.skip(length, f"{field} (a string of {length} bytes)")
        try:
            return bytes(self.data[start : start + length]).decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(f"{field} is not UTF-8 ({error.reason})") from None


# GGUF scalar value types: their struct formats (7 is a bool).
SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
    11: "<q", 12: "<d",
}  # fmt: skip


def _value(cursor: _Cursor, kind: int, field: str, depth: int = 0) -> Any:
    """One metadata value, read: a number, a bool, a string or a list of them."""
    if kind in SCALAR_SIZES:
        return cursor.unpack(SCALAR_FORMATS[kind], field)
    if kind == STRING:
        return cursor.string(field)
    if kind != ARRAY:
        raise cursor.fail(f"{field}: unknown value type {kind}")
    if depth == MAX_NESTING:
        raise cursor.fail(f"{field}: arrays nested more than {MAX_NESTING} deep")
    item = cursor.unpack("<I", f"{field}'s item type")
    if item not in SCALAR_SIZES and item not in (STRING, ARRAY):
        raise cursor.fail(f"{field}: unknown array item type {item}")
    each = SCALAR_SIZES.get(item, 8 if item == STRING else 12)
    count = cursor.count(f"{field}'s item count", each)
    if item in SCALAR_SIZES:  # read at once: a vocabulary's scores are 100,000s of them
        start = cursor.skip(count * each, f"{field}'s {count} items")
        dtype = np.dtype(SCALAR_FORMATS[item])
        return np.frombuffer(cursor.data, dtype, count, start).tolist()
    return [_value(cursor, item, f"{field} item {index}", depth + 1) for index in range(count)]


def _tensor_info(cursor: _Cursor, index: int, block_sizes: dict[int, tuple[int, int]]):
    name = cursor.string(f"tensor {index}'s name")
    field = f"tensor {name!r}"
    n_dims = cursor.unpack("<I", f"{field}'s dimension count")
    if n_dims > MAX_DIMS:
        raise cursor.fail(f"{field} has {n_dims} dimensions (at most {MAX_DIMS})")
    dims = tuple(cursor.unpack("<Q", f"{field}'s dimension {d}") for d in range(n_dims))
    type_code = cursor.unpack("<I", f"{field}'s type")
    if type_code not in block_sizes:
        raise cursor.fail(f"{field}: unknown ggml type {type_code}")
    offset = cursor.unpack("<Q", f"{field}'s data offset")
    values, block_bytes = block_sizes[type_code]
    if dims and dims[0] % values:
        from gguf.constants import GGMLQuantizationType

        kind = GGMLQuantizationType(type_code).name
        raise cursor.fail(
            f"{field}: rows of {dims[0]} values are not whole {kind} blocks of {values}"
        )
    elements = 1
    for dim in dims:
        elements *= dim
    return name, dims, type_code, offset, elements // values * block_bytes


def walk(path: str | Path) -> Header:
    """The header of the GGUF file at ``path``, every part of it checked to lie in the
    file; a ``ValueError`` naming the file and the field otherwise."""
    from gguf.constants import GGML_QUANT_SIZES

    path = Path(path)
    block_sizes = {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
    with path.open("rb") as file:
        size = path.stat().st_size
        data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        try:
            return _walk(_Cursor(path, data), block_sizes)
        finally:
            if isinstance(data, mmap.mmap):
                data.close()


def _walk(cursor: _Cursor, block_sizes: dict[int, tuple[int, int]]) -> Header:
    start = cursor.skip(4, "the magic")
    magic = bytes(cursor.data[start : start + 4])
    if magic != MAGIC:
        raise cursor.fail(f"not a GGUF file: its magic is {magic!r}, not {MAGIC!r}")
    version = cursor.unpack("<I", "the version")
    if version not in VERSIONS:
        raise cursor.fail(f"GGUF version {version} is not read (versions {VERSIONS} are)")
    tensor_count = cursor.unpack("<Q", "the tensor count")
    pair_count = cursor.count("the metadata key count", MIN_PAIR_BYTES)
    if tensor_count * MIN_TENSOR_BYTES > cursor.size - cursor.at:
        raise cursor.fail(
            f"the tensor count {tensor_count} cannot fit in the file: that many take at "
            f"least {tensor_count * MIN_TENSOR_BYTES} bytes, {cursor.size - cursor.at} are left"
        )
    fields: dict[str, Any] = {}
    alignment = DEFAULT_ALIGNMENT
    for index in range(pair_count):
        key = cursor.string(f"metadata key {index}")
        if key in fields:
            raise cursor.fail(f"metadata {key!r} appears twice")
        kind = cursor.unpack("<I", f"metadata {key!r}'s type")
        fields[key] = _value(cursor, kind, f"metadata {key!r}")
        if key == "general.alignment":
            value = fields[key]
            if kind != 4 or value == 0 or value & (value - 1):
                raise cursor.fail(
                    "general.alignment must be a uint32 power of two, not "
                    f"{value!r} (of value type {kind})"
                )
            alignment = value
    described = [_tensor_info(cursor, index, block_sizes) for index in range(tensor_count)]
    names = [name for name, *_ in described]
    if len(set(names)) != len(names):
        repeated = next(name for name in names if names.count(name) > 1)
        raise cursor.fail(f"tensor {repeated!r} appears twice")
    data_start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, dims, type_code, offset, n_bytes in described:
        start = data_start + offset
        if offset % alignment:
            raise cursor.fail(
                f"tensor {name!r}'s data offset {offset} is not a multiple of the alignment "
                f"{alignment}"
            )
        if start + n_bytes > cursor.size:
            raise cursor.fail(
                f"tensor {name!r}'s data (offset {offset}, {n_bytes} bytes) runs past the end "
                f"of the file ({cursor.size} bytes): it is truncated or corrupt"
            )
        tensors.append(TensorInfo(name, dims, type_code, start, n_bytes))
    _refuse_overlaps(cursor, tensors, data_start)
    return Header(version, alignment, data_start, tuple(tensors), fields)


def _refuse_overlaps(cursor: _Cursor, tensors: list[TensorInfo], data_start: int) -> None:
    """Two tensors sharing bytes: a write into one would change the other, and no
    writer lays a file out so."""
    last = None
    for tensor in sorted((t for t in tensors if t.n_bytes), key=lambda t: t.start):
        if last is not None and tensor.start < last.start + last.n_bytes:
            raise cursor.fail(
                f"tensor {tensor.name!r}'s data (offset {tensor.start - data_start}, "
                f"{tensor.n_bytes} bytes) overlaps tensor {last.name!r}'s (offset "
                f"{last.start - data_start}, {last.n_bytes} bytes)"
            )
        last = tensor


@dataclass(frozen=True)
class Tensor:
    """One tensor of a file read: ``shape`` in ggml's order (the row width first);
    ``data`` a read-only view of the file's map (floats typed, blocks as rows of bytes)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]
    tensors: list[Tensor]


# Types whose values numpy holds as they are; any other is read as rows of bytes.
NUMPY_TYPES = {
    0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
    28: np.float64,
}  # fmt: skip


def read_gguf(path: str | Path) -> GGUFFile:
    """The file at ``path``, once its header has been ``walk``ed: its metadata and its
    tensors over one memory map of the file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    header = walk(path)
    # Copy-on-write: a float weight is used where it lies in the map (models/gguf_tensors.py),
    # and a write into one, should any code make it, changes this process's page, never
    # the file, nor faults on a read-only page.
    whole = np.memmap(path, dtype=np.uint8, mode="c")
    tensors = []
    for info in header.tensors:
        kind = GGMLQuantizationType(info.type_code)
        raw = whole[info.start : info.start + info.n_bytes]
        shape = tuple(reversed(info.dims))
        if info.type_code in NUMPY_TYPES:
            data = raw.view(NUMPY_TYPES[info.type_code]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(Tensor(info.name, kind, info.dims, data))
    return GGUFFile(header.fields, tensors)
