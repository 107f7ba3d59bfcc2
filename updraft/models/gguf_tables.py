"""A GGUF file's tables that a model maps rather than loads (``mapped_table.py``:
Gemma 4's per-layer input embeddings), left in the file's memory map in the file's
type and read by row.

A float table (F32, F16, BF16) is the file's own bytes viewed as a tensor of its dtype
and attached to the model's ``MappedEmbedding``; a table in blocks (Q8_0 and the other
block types the kernels read) puts a ``BlockTable`` in its place, which widens only the
blocks of the rows a step looks up. Neither copies the table.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from updraft.kernels.gguf_ops import BLOCK_TYPES, BLOCKS
from updraft.models.gguf_tensors import FLOAT_DTYPES, block_rows
from updraft.models.mapped_table import MappedEmbedding


class BlockTable(nn.Module):
    """A ``MappedEmbedding``'s rows in GGUF blocks of type ``code``: each looked-up row
    widened to float32, then to the compute dtype, and scaled as the table's are."""

    def __init__(self, table: MappedEmbedding, blocks: torch.Tensor, code: int) -> None:
        super().__init__()
        self.name, self.shape, self.scales = table.name, table.shape, table.scales
        self.code = code
        self.register_buffer("blocks", blocks, persistent=False)

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids)
        widened = torch.ops.updraft.gguf_dequantize(rows, self.code, self.shape[1])
        return widened.to(dtype) * self.scales[dtype]

    def extra_repr(self) -> str:
        return f"rows={self.shape[0]}, width={self.shape[1]}, in GGUF blocks"


class GGUFTables:
    """The model's mapped tables, each filled from the GGUF tensor of its name as a
    file's tensors stream by (``take``); ``finish`` refuses a table the files lack."""

    def __init__(self, model: nn.Module, file_name: str) -> None:
        self.file_name = file_name
        self.paths = {
            module.name: path
            for path, module in model.named_modules()
            if isinstance(module, MappedEmbedding)
        }
        self.model = model
        self.filled: set[str] = set()

    def take(self, gguf_name: str, name: str | None, kind: str, data: np.ndarray) -> bool:
        """Fill the table named ``name`` (transformers' name of GGUF tensor
        ``gguf_name``) from ``data``, in type ``kind`` (True); any other tensor is left."""
        path = self.paths.get(name)
        if path is None:
            return False
        table = self.model.get_submodule(path)
        rows, width = table.shape
        if kind in FLOAT_DTYPES:
            values = block_rows(data)
            values = values.view(torch.bfloat16) if kind == "BF16" else values
            self._check(gguf_name, kind, tuple(values.shape), (rows, width), width)
            table.attach(values)
        elif kind in BLOCK_TYPES:
            code = BLOCK_TYPES[kind]
            values, size = BLOCKS[code]
            shape = (rows, width // values * size) if width % values == 0 else None
            self._check(gguf_name, kind, tuple(data.shape), shape, width)
            parent, _, child = path.rpartition(".")
            blocks = BlockTable(table, block_rows(data), code)
            setattr(self.model.get_submodule(parent), child, blocks)
        else:
            raise ValueError(f"{self.file_name}: {gguf_name} is in {kind}, which cannot be read")
        self.filled.add(name)
        return True

    def _check(self, gguf_name: str, kind: str, got: tuple, want: tuple | None, width: int) -> None:
        if got != want:
            raise ValueError(
                f"{self.file_name}: {gguf_name} ({kind}) has shape {list(got)}, not the "
                f"model's table of rows of {width}"
                + ("" if want is None else f" ({list(want)} as the file lays it out)")
            )

    def finish(self) -> None:
        missing = sorted(set(self.paths) - self.filled)
        if missing:
            raise ValueError(f"{self.file_name}: no GGUF tensor for the table {missing[0]}")
