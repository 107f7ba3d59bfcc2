"""A GGUF file as editable parts, and the bytes they make, with where each number lies.

The hostile-file tests change a good file one field at a time: a metadata value (of any
type, even a wrong one), a key repeated, a tensor's name, shape, type or offset. gguf-py's
writer checks what it writes, so it cannot write most of these; ``GGUFParts.to_bytes``
writes whatever the parts say, GGUF's layout as the specification gives it, and records
the offset and struct format of every count, length, type code, dimension and offset it
wrote, so a test can then overwrite one of them with a value no writer would produce.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class Value:
    """A metadata value: its type and, for an array, its items' type."""

    kind: GGUFValueType
    value: Any
    item: GGUFValueType | None = None


@dataclass(frozen=True)
class TensorPart:
    name: str
    dims: tuple[int, ...]  # ggml's order: the row width first
    type_code: int
    data: bytes


@dataclass(frozen=True)
class Number:
    """A number the writer put in the header: what it stands for, where, in what format."""

    label: str
    offset: int
    fmt: str


@dataclass
class GGUFParts:
    metadata: list[tuple[str, Value]]  # in order; a key may repeat
    tensors: list[TensorPart]
    alignment: int = 32
    numbers: list[Number] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> GGUFParts:
        reader = GGUFReader(str(path))
        metadata = []
        for key, reader_field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            kind = reader_field.types[0]
            item = reader_field.types[-1] if kind == GGUFValueType.ARRAY else None
            metadata.append((key, Value(kind, reader_field.contents(), item)))
        tensors = [
            TensorPart(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data.tobytes())
            for t in reader.tensors
        ]
        return cls(metadata, tensors)

    def with_value(self, key: str, value: Any, kind: GGUFValueType | None = None) -> GGUFParts:
        """A copy with ``key``'s value replaced (added at the end when absent)."""
        metadata = list(self.metadata)
        for index, (name, old) in enumerate(metadata):
            if name == key:
                metadata[index] = (key, replace(old, value=value, kind=kind or old.kind))
                return replace(self, metadata=metadata, numbers=[])
        metadata.append((key, Value(kind or GGUFValueType.UINT32, value)))
        return replace(self, metadata=metadata, numbers=[])

    def without(self, key: str) -> GGUFParts:
        metadata = [(name, value) for name, value in self.metadata if name != key]
        return replace(self, metadata=metadata, numbers=[])

    def to_bytes(self, offsets: list[int] | None = None) -> bytes:
        """The file; each tensor's data offset packed after the last one's unless
        ``offsets`` says otherwise. Fills ``numbers``."""
        self.numbers = []
        out = bytearray(b"GGUF")
        self._put(out, "version", "<I", 3)
        self._put(out, "tensor count", "<Q", len(self.tensors))
        self._put(out, "metadata key count", "<Q", len(self.metadata))
        for key, value in self.metadata:
            self._string(out, f"key {key}", key)
            self._put(out, f"{key} type", "<I", int(value.kind))
            self._value(out, key, value.kind, value.value, value.item)
        packed, at = [], 0
        for tensor in self.tensors:
            packed.append(at)
            at += -(-len(tensor.data) // self.alignment) * self.alignment
        for index, tensor in enumerate(self.tensors):
            self._string(out, f"tensor {index} name", tensor.name)
            self._put(out, f"tensor {tensor.name} dimension count", "<I", len(tensor.dims))
            for d, dim in enumerate(tensor.dims):
                self._put(out, f"tensor {tensor.name} dimension {d}", "<Q", dim)
            self._put(out, f"tensor {tensor.name} type", "<I", tensor.type_code)
            offset = packed[index] if offsets is None else offsets[index]
            self._put(out, f"tensor {tensor.name} offset", "<Q", offset)
        out += bytes(-len(out) % self.alignment)
        data_start = len(out)
        for tensor, offset in zip(self.tensors, packed, strict=True):
            out += bytes(data_start + offset - len(out)) + tensor.data
        return bytes(out)

    def _put(self, out: bytearray, label: str, fmt: str, value: Any) -> None:
        self.numbers.append(Number(label, len(out), fmt))
        out += struct.pack(fmt, value)

    def _string(self, out: bytearray, label: str, text: str) -> None:
        encoded = text.encode()
        self._put(out, f"{label} length", "<Q", len(encoded))
        out += encoded

    def _value(self, out: bytearray, label: str, kind, value, item) -> None:
        if kind == GGUFValueType.STRING:
            self._string(out, label, value)
        elif kind == GGUFValueType.ARRAY:
            self._put(out, f"{label} item type", "<I", int(item))
            self._put(out, f"{label} item count", "<Q", len(value))
            for index, entry in enumerate(value):
                self._value(out, f"{label} item {index}", item, entry, None)
        else:
            self._put(out, label, SCALARS[kind], value)


def patched(data: bytes, number: Number, value: int) -> bytes:
    """``data`` with ``number`` overwritten by ``value`` (cut to its format's width)."""
    width = struct.calcsize(number.fmt)
    raw = (value % (1 << (8 * width))).to_bytes(width, "little")
    return data[: number.offset] + raw + data[number.offset + width :]


def number(parts: GGUFParts, label: str) -> Number:
    return next(n for n in parts.numbers if n.label == label)
