"""Linear layers for float32 on the CPU: oneDNN with prepacked weights, and updraft's
own kernel for few rows.

PyTorch's default CPU path for a matrix-vector product (a decode step's every
projection) streams a weight at about half the machine's memory bandwidth; oneDNN with a
weight reordered once at load time ("prepacked", as vLLM's CPU backend and inductor's
freezing do) is the fast path for batches. For few rows (batch-1 decode, which reads
every weight once per token and does little else, and a small batch or a speculative
verify step) updraft's own kernel ``updraft::float_linear`` is faster: it reads the
weight in panels of 16 output rows packed at load time (``pack_panels``), at the
memory's full speed for one row and with every row's multiply-adds done on each weight
as it is read. So a layer keeps both packings: the panels for few rows (``FEW_ROWS``,
more for a model that fits in cache) and oneDNN's for more. That is twice the linear
weights' memory, the price of both speeds; int8 keeps one copy.

The reordered weight is an opaque oneDNN tensor: it has no storage to view or copy, and
nothing but ``_linear_pointwise`` reads it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from torch import nn

from updraft.kernels.ops import kernel_builds, pack_panels

# The row count oneDNN lays a weight out for. Any count runs on the layout, but one laid
# out for a single row ran 1.2-2x slower from 4 rows up (a batched decode step), while
# one laid out for 16 rows ran a single row as fast (benchmarks/RESULTS.md).
PACKED_FOR_ROWS = 16
# Up to this many rows the panel kernel runs: on weights streamed from memory it is
# 1.1-1.6x faster than oneDNN up to 4 rows, and oneDNN is faster from 5
# (benchmarks/RESULTS.md).
FEW_ROWS = 4
# A model whose linear weights fit in a server CPU's last-level cache is bound by compute,
# not reads: there the panel kernel is as fast as oneDNN or faster up to 9 rows, and what
# matters more is that a batch-1 speculative round (1-row draft steps, a verify step of
# 1 + k <= 9 rows) stays on one copy of the weights. Alternating with oneDNN's packed copy
# keeps both in cache, and a 6-row verify step of the demo model ran 1.4x slower
# (benchmarks/RESULTS.md).
CACHED_FEW_ROWS = 9
# Where the machine does not say how large its last-level cache is.
DEFAULT_CACHE_BYTES = 32 * 2**20


SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


@cache
def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the CPU's largest-level cache, as Linux reports it in ``caches``."""
    sizes = {}
    for index in caches.glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if size[-1:] in SIZE_UNITS and size[:-1].isdigit():
            sizes[level] = int(size[:-1]) * SIZE_UNITS[size[-1]]
    return sizes[max(sizes)] if sizes else DEFAULT_CACHE_BYTES


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, few_rows: int = FEW_ROWS) -> None:
        super().__init__()
        self.few_rows = few_rows  # up to this many rows, the panel kernel
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        panels = pack_panels(weight) if kernel_builds("linear") else None
        self.register_buffer("panels", panels, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features  # a Python int: fixed within a captured step
        if self.panels is not None and rows <= self.few_rows:
            flat = x.reshape(rows, self.in_features)
            out = torch.ops.updraft.float_linear(flat, self.panels, self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` of ``model`` (after its weights are loaded) by a
    ``PackedLinear``; a weight tied to an embedding stays for the embedding. A model
    whose linear weights fit in the last-level cache runs up to ``CACHED_FEW_ROWS`` rows
    on the panel kernel."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weights = {m.weight.data_ptr(): m.weight.nbytes for m in linears}
    few_rows = CACHED_FEW_ROWS if sum(weights.values()) <= last_level_cache_bytes() else FEW_ROWS
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, few_rows))
