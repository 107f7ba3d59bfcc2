"""A GGUF file's header walked with every count, length and offset checked against the
file's size, before gguf-py's ``GGUFReader`` reads it.

``GGUFReader`` believes what a header says: a string length or element count past the
end of the file makes it slice short arrays and fail later with an ``IndexError`` or a
reshape error from numpy, and a tensor count of 2^60 sends it round a loop of that
length. Here the header is read from a memory map with ``struct``, nothing is allocated
in proportion to what it claims, and the first claim the file cannot hold is refused
in one line that names the file and the field: a wrong magic, a truncated header, a
count or length past the end, an unknown value or tensor type, a tensor whose data runs
past the end of the file. ``read_gguf`` returns the ``GGUFReader`` of a file that passed.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gguf import GGUFReader

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


def _value(cursor: _Cursor, kind: int, field: str, depth: int = 0) -> int | None:
    """Step over one metadata value; an unsigned 32-bit integer's value is returned
    (``general.alignment`` is one), else None."""
    if kind in SCALAR_SIZES:
        if kind == 4:
            return cursor.unpack("<I", field)
        cursor.skip(SCALAR_SIZES[kind], field)
    elif kind == STRING:
        length = cursor.unpack("<Q", f"{field}'s length")
        cursor.skip(length, f"{field} (a string of {length} bytes)")
    elif kind == ARRAY:
        if depth == MAX_NESTING:
            raise cursor.fail(f"{field}: arrays nested more than {MAX_NESTING} deep")
        item = cursor.unpack("<I", f"{field}'s item type")
        if item not in SCALAR_SIZES and item not in (STRING, ARRAY):
            raise cursor.fail(f"{field}: unknown array item type {item}")
        each = SCALAR_SIZES.get(item, 8 if item == STRING else 12)
        count = cursor.count(f"{field}'s item count", each)
        if item in SCALAR_SIZES:
            cursor.skip(count * each, f"{field}'s {count} items")
        else:
            for index in range(count):
                _value(cursor, item, f"{field} item {index}", depth + 1)
    else:
        raise cursor.fail(f"{field}: unknown value type {kind}")
    return None


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
        raise cursor.fail(
            f"{field}: rows of {dims[0]} values are not whole blocks of {values} (type {type_code})"
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
    alignment = DEFAULT_ALIGNMENT
    for index in range(pair_count):
        key = cursor.string(f"metadata key {index}")
        kind = cursor.unpack("<I", f"metadata {key!r}'s type")
        value = _value(cursor, kind, f"metadata {key!r}")
        if key == "general.alignment":
            if value is None or value == 0 or value & (value - 1):
                raise cursor.fail(
                    "general.alignment must be a uint32 power of two, not "
                    f"{'a value of type ' + str(kind) if value is None else value}"
                )
            alignment = value
    described = [_tensor_info(cursor, index, block_sizes) for index in range(tensor_count)]
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
    return Header(version, alignment, data_start, tuple(tensors))


def read_gguf(path: str | Path) -> GGUFReader:
    """gguf-py's reader of the file at ``path``, once its header has been ``walk``ed;
    whatever the reader still refuses (a duplicated key or tensor name) comes back as a
    ``ValueError`` naming the file."""
    from gguf import GGUFReader

    walk(path)
    try:
        return GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise ValueError(f"{path}: not a readable GGUF file ({error})") from None
