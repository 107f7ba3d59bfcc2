"""A checkpoint file's mapped pages, given back as loading finishes with each tensor.

Loading reads a quantized tensor's bytes from the file's memory map once, to regroup
them (``gguf_group``) or pack them into panels, and every page read stays in this
process's resident set while the map lives. Kept until the whole model was loaded
(``weight_memory.release_unkept_pages``), they put the file and its new layout in memory
at once: a 500M model's Q4_0 file (363 MiB) peaked at the file twice over. So as soon
as the module built from a tensor no longer views it, the whole pages that lie inside
the tensor are dropped (``MADV_DONTNEED``: the page cache keeps them, and a later read
maps them again). A page the tensor shares with a neighbour is left alone, so a weight
kept in the map never loses a page.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from updraft.checkpoints.gguf_header import GGUFFile, Tensor
from updraft.models.weight_memory import drop_pages, extent
from updraft.resident import give_back_free_memory

# Bytes of float weights packed between two trims of the heap (``dropped_after_packing``).
TRIM_EVERY_BYTES = 64 * 2**20


class MappedSpans:
    """The address ranges of the files' maps a loader reads from: only pages inside one
    are ever dropped (an anonymous copy's pages are its data)."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self.dropped = 0  # bytes given back so far
        self.packed = 0  # bytes of weights packed since the heap was last trimmed

    def tensors(self, file: GGUFFile) -> list[Tensor]:
        """A GGUF file's tensors, its map noted as the range they lie in."""
        arrays = [tensor.data for tensor in file.tensors if tensor.data.nbytes]
        if arrays:
            starts = [a.ctypes.data for a in arrays]
            ends = [a.ctypes.data + a.nbytes for a in arrays]
            self.spans.append((min(starts), max(ends)))
        return file.tensors

    def drop_unheld(self, tensors: Iterable[torch.Tensor], module: nn.Module) -> int:
        """Drop the whole pages of each of ``tensors`` that lies in a map and that none
        of ``module``'s weights overlaps (it was read into another layout) -> bytes."""
        held = [extent(t) for t in [*module.parameters(), *module.buffers()] if _plain(t)]
        dropped = 0
        for tensor in filter(_plain, tensors):
            start, end = extent(tensor)
            inside = any(low <= start and end <= high for low, high in self.spans)
            if inside and not any(a < end and start < b for a, b in held):
                dropped += drop_pages(start, end)
        self.dropped += dropped
        return dropped

    def dropped_after_packing(self, replaced: nn.Module, module: nn.Module) -> None:
        """A float linear or a layer's experts once packed into another layout: the file
        pages of its parameters that none of ``module``'s weights views dropped, the
        parameters let go (the replaced module may outlive its packing in a loader's
        table of modules, and must not keep a joined copy alive), and the heap's free
        pages given back every ``TRIM_EVERY_BYTES`` of weights (glibc keeps what is
        freed)."""
        weights = []
        for name, param in list(replaced.named_parameters(recurse=False)):
            setattr(replaced, name, nn.Parameter(param.to("meta"), requires_grad=False))
            weights.append(param)
        self.drop_unheld(weights, module)
        self.packed += sum(weight.untyped_storage().nbytes() for weight in weights)
        del weights
        if self.packed >= TRIM_EVERY_BYTES:
            give_back_free_memory()
            self.packed = 0


def _plain(tensor: torch.Tensor) -> bool:
    return (
        tensor.layout == torch.strided
        and not tensor.is_mkldnn
        and not tensor.is_meta
        and tensor.device.type == "cpu"
        and tensor.numel() > 0
    )
