"""A table too large to copy, read by row straight from its checkpoint file.

Gemma 4's per-layer input embeddings are a [vocabulary, layers x width] table (4.7 GB in
bfloat16 for its E4B) of which a step reads a few rows. ``MappedEmbedding`` keeps it on a
private memory mapping of the safetensors file, in the file's dtype: the OS reads the
pages a step's rows lie on, and the rows alone are widened to the compute dtype. The
loader (``loader.py``) maps the tensor named by each such module instead of copying it.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
from torch import nn

SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}


class MappedEmbedding(nn.Module):
    """Rows of a table mapped from checkpoint tensor ``name`` (as the text model calls
    it), widened to the compute dtype and scaled by ``scale`` rounded to it, as the
    reference's scaled embedding rounds its scale to its weights' dtype."""

    def __init__(self, name: str, rows: int, width: int, scale: float) -> None:
        super().__init__()
        self.name = name
        self.shape = (rows, width)
        self.scales = rounded(scale)
        # A buffer, so that a captured graph knows it as the model's own; filled by
        # ``attach`` once the file is mapped.
        self.register_buffer("weight", None, persistent=False)

    def attach(self, table: torch.Tensor) -> None:
        if tuple(table.shape) != self.shape:
            raise ValueError(
                f"tensor {self.name} has shape {tuple(table.shape)}; the model's is {self.shape}"
            )
        self.weight = table

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = self.weight.index_select(0, input_ids).to(dtype)
        return rows * self.scales[dtype]


def rounded(value: float) -> dict[torch.dtype, float]:
    """``value`` as each compute dtype holds it (the reference rounds its embedding
    scales to its weights' dtype: sqrt(3072) is 55.5 in bfloat16)."""
    return {
        dtype: torch.tensor(value, dtype=dtype, device="cpu").item()
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    }


def mapped_tensor(path: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of safetensors file ``path`` on a private (copy-on-write) mapping
    of the file: no byte is read until a row is."""
    with path.open("rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_size))
        memory = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    entry = header.get(name)
    if entry is None:
        raise ValueError(f"{path.name} holds no tensor {name}")
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(
            f"{path.name}: tensor {name} is {entry['dtype']}; a mapped table must be one of "
            f"{', '.join(SAFETENSORS_DTYPES)}"
        )
    start, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    count = (end - start) // dtype.itemsize
    if count != int(torch.Size(shape).numel()):
        raise ValueError(f"{path.name}: tensor {name}'s bytes do not match its shape {shape}")
    offset = 8 + header_size + start
    # The tensor holds the mapping: it is unmapped when the tensor is freed.
    return torch.frombuffer(memory, dtype=dtype, count=count, offset=offset).view(shape)
