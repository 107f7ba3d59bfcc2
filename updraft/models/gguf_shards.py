"""A GGUF file's tensors split over tensor-parallel ranks, as ``tensor_parallel.py``
splits a safetensors checkpoint: each rank copies out of the file's map only the rows
and columns it keeps.

* A column-parallel tensor (q/k/v, gate/up, the vocabulary rows of the embedding and the
  LM head) is split by rows; a row of blocks is whole, so any type splits. The last
  vocabulary shard is padded with rows of zero bytes, which every block type reads as
  zeros.
* A row-parallel tensor (o_proj, down_proj) is split along its inputs: each row's
  blocks are dealt out, a block never cut. A width whose share per rank is not a whole
  number of blocks is refused, with the numbers, before any rank loads
  (``gguf_loader.check_gguf_split``).
* A layer's stacked experts ([experts, rows, columns]) split as a safetensors
  checkpoint's experts do: every expert keeps its share of the intermediate rows of
  gate and up (``ffn_gate_exps``/``ffn_up_exps``, each half of a fused
  ``ffn_gate_up_exps``) and of down's inputs (``ffn_down_exps``, whose blocks are dealt
  out whole as a row-parallel linear's are).
* Float tensors split as a safetensors checkpoint's do.

llama.cpp's q/k row permutation turns rows within each head, and a rank keeps whole
heads, so the rows a rank keeps are un-permuted on their own.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch
from torch import nn

from updraft.kernels.gguf_ops import BLOCK_TYPES, BLOCKS
from updraft.models.tensor_parallel import (
    Kept,
    Rows,
    Shards,
    VocabParallelEmbedding,
    pieces,
    shard_model,
    splits_tensors,
)
from updraft.models.weight_targets import FUSED, Slice
from updraft.parallel.topology import RankPlace

T = TypeVar("T")


def block_columns(name: str, kind: str, width: int, columns: slice, ranks: int) -> slice:
    """The bytes of each row of ``name`` (rows of ``width`` values in ``kind``'s blocks)
    that hold input columns ``columns``; refused where they would cut a block."""
    values, block_bytes = BLOCKS[BLOCK_TYPES[kind]]
    share = columns.stop - columns.start
    if columns.start % values or share % values:
        raise ValueError(
            f"{name}: {width} inputs in {kind} blocks of {values} cannot be split over "
            f"{ranks} ranks: {share} each is not a whole number of blocks"
        )
    return slice(columns.start // values * block_bytes, columns.stop // values * block_bytes)


def rank_share(
    name: str,
    kind: str,
    data: np.ndarray,
    keep: Kept | None,
    index: Slice,
    split_sizes: list[int] | None,
    ranks: int,
) -> np.ndarray:
    """What the rank keeps of GGUF tensor ``name`` (``data``: the file's rows, floats or
    block bytes), which fills slice ``index`` of a parameter the rank keeps as
    ``keep``; ``split_sizes``: the unsplit fused projection's parts."""
    if keep is not None and keep.zeros:  # a row-parallel bias: rank 0 alone adds it
        return np.zeros_like(data)
    if keep is None or keep.dim is None:
        return data
    if index == FUSED:  # every part of a fused projection, each its own rows
        starts = np.cumsum([0, *split_sizes[:-1]])
        return np.concatenate(
            [_kept_rows(data, rows, start) for start, rows in zip(starts, keep.parts, strict=True)]
        )
    kept = kept_part(keep, index)
    if keep.dim == 0:
        return _kept_rows(data, kept)
    if kind in BLOCK_TYPES:
        values, block_bytes = BLOCKS[BLOCK_TYPES[kind]]
        width = data.shape[1] // block_bytes * values
        columns = block_columns(name, kind, width, kept, ranks)
    else:
        columns = kept
    return np.ascontiguousarray(data[:, columns])  # the kernels read whole rows


def _kept_rows(data: np.ndarray, rows: Rows, start: int = 0) -> np.ndarray:
    """The rows of ``data`` from ``start`` on that ``rows`` says, end to end; rows past
    its end (the last vocabulary shard's) are zero bytes."""
    kept = []
    for piece in pieces(rows):
        read = data[start + piece.start : start + piece.stop]
        short = piece.stop - piece.start - read.shape[0]
        if short:
            read = np.concatenate([read, np.zeros((short, *read.shape[1:]), read.dtype)])
        kept.append(read)
    return np.concatenate(kept) if len(kept) > 1 else kept[0]


def expert_share(
    name: str, kind: str, data: np.ndarray, proj: str, keep: Kept, ranks: int
) -> np.ndarray:
    """What the rank keeps of the stacked expert tensor ``name`` (``data``: [experts,
    rows, columns or row bytes]) of projection ``proj`` (gate, up, gate_up or down),
    whose intermediate rows the rank keeps as ``keep.parts[0]`` says."""
    rows = keep.parts[0]
    if proj == "down":
        if kind in BLOCK_TYPES:
            values, block_bytes = BLOCKS[BLOCK_TYPES[kind]]
            width = data.shape[2] // block_bytes * values
            rows = block_columns(name, kind, width, rows, ranks)
        return np.ascontiguousarray(data[:, :, rows])
    if proj == "gate_up":  # gate's rows, then up's: the rank's share of each
        inter = data.shape[1] // 2
        up = slice(inter + rows.start, inter + rows.stop)
        return np.concatenate([data[:, rows], data[:, up]], axis=1)
    return np.ascontiguousarray(data[:, rows])


def kept_part(keep: Kept, index: Slice) -> Rows:
    """What the rank keeps of slice ``index`` (a fused projection's part, an expert's
    gate or up) along ``keep.dim``."""
    return keep.parts[index[1] if isinstance(index, tuple) else index]


class RankShare:
    """What the rank at ``place`` keeps of ``model`` (built on the meta device), which it
    splits in place: its share of each GGUF tensor, named by the unsplit model's
    parameters; with no ``place``, or one that splits no tensor, all of each."""

    def __init__(self, model: nn.Module, place: RankPlace | None) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.kept: Shards = shard_model(model, place) if splits_tensors(place) else {}
        self.ranks = place.sizes.tensor if self.kept else 1

    def __call__(self, name: str, kind: str, data: np.ndarray, param: str, index: Slice):
        """The rank's share of GGUF tensor ``name`` (``data``: the file's rows, floats
        or block bytes in ``kind``), which fills slice ``index`` of ``param``."""
        module = self.modules[param.rpartition(".")[0]]
        keep = self.kept.get(self.params[param])
        sizes = getattr(module, "split_sizes", None)
        return rank_share(name, kind, data, keep, index, sizes, self.ranks)

    def experts(self, name: str, kind: str, data: np.ndarray, module: str, proj: str) -> np.ndarray:
        """The rank's share of the stacked expert tensor ``name`` (projection ``proj``)
        of the experts ``module``."""
        if not self.kept:
            return data
        keep = self.kept[self.params[f"{module}.down_proj"]]
        return expert_share(name, kind, data, proj, keep, self.ranks)

    def renamed(self, by_param: dict[str, T]) -> dict[str, T]:
        """``by_param`` keyed by the names of what the rank keeps in the split model (a
        row-parallel linear's weight is ``...o_proj.module.weight``)."""
        if not self.kept:
            return by_param
        names = {id(param): name for name, param in self.model.named_parameters()}
        renamed = {}
        for name, value in by_param.items():
            keep = self.kept.get(self.params[name])
            held = keep.param if keep is not None else self.params[name]
            renamed[names[id(held)]] = value
        return renamed


class VocabParallelBlocks(nn.Module):
    """The rank's rows of an embedding in blocks (a ``GGUFEmbedding``); other ids look
    up zeros here and their rows come from the rank that holds them."""

    def __init__(self, table: nn.Module, first: int, group: str) -> None:
        super().__init__()
        self.table = table
        self.first = first
        self.group = group
        self.num_embeddings = table.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        rows = self.table(local.clamp(0, self.num_embeddings - 1))
        return torch.ops.updraft.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype), self.group)


def embedding_over(current: nn.Module, table: nn.Module) -> nn.Module:
    """``table`` in the place of the embedding ``current``: vocabulary-parallel where
    ``current`` was."""
    if isinstance(current, VocabParallelEmbedding):
        return VocabParallelBlocks(table, current.first, current.group)
    return table
