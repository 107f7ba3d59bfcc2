"""Linear layers for float32 on the CPU: oneDNN with prepacked weights, and updraft's
own kernel for few rows.

PyTorch's default CPU path for a matrix-vector product (a decode step's every
projection) streams a weight at about half the machine's memory bandwidth; oneDNN with a
weight reordered once at load time ("prepacked", as vLLM's CPU backend and inductor's
freezing do) is the fast path for batches. For one or two rows (batch-1 decode, which
reads every weight once per token and does little else) oneDNN still reads at 15-21
GB/s where the machine streams 28-32; the plain row-streaming kernel
``updraft::float_linear`` reads at 24-32 GB/s, 1.3-1.7x faster (benchmarks/RESULTS.md).
So a layer keeps both: the plain weight for few rows (``FEW_ROWS``, more for a model
that fits in cache) and the packed one for more. That
is twice the linear weights' memory, the price of both speeds; int8 keeps one copy.

The reordered weight is an opaque oneDNN tensor: it has no storage to view or copy, and
nothing but ``_linear_pointwise`` reads it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from torch import nn

from updraft.kernels.ops import kernel_builds

# The row count oneDNN lays a weight out for. Any count runs on the layout, but one laid
# out for a single row ran 1.2-2x slower from 4 rows up (a batched decode step), while
# one laid out for 16 rows ran a single row as fast (benchmarks/RESULTS.md).
PACKED_FOR_ROWS = 16
# Up to this many rows the plain kernel runs: one or two, where it reads weights faster
# than oneDNN; from 3 rows oneDNN reads a weight streamed from memory 1.1-1.7x faster.
FEW_ROWS = 2
# A model whose linear weights fit in a server CPU's last-level cache is bound by compute,
# not reads: there the plain kernel is within about 10% of oneDNN up to 9 rows, and what
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
        self.few_rows = few_rows  # up to this many rows, the plain kernel
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        # The loaded weight itself (no copy): nothing writes it, and a tied LM head then
        # shares the embedding's memory.
        plain = weight.contiguous() if kernel_builds("linear") else None
        self.register_buffer("weight", plain, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features  # a Python int: fixed within a captured step
        if self.weight is not None and rows <= self.few_rows:
            flat = x.reshape(rows, self.in_features)
            out = torch.ops.updraft.float_linear(flat, self.weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` of ``model`` (after its weights are loaded) by a
    ``PackedLinear``; a weight tied to an embedding stays for the embedding. A model
    whose linear weights fit in the last-level cache runs up to ``CACHED_FEW_ROWS`` rows
    on the plain kernel."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weights = {m.weight.data_ptr(): m.weight.nbytes for m in linears}
    few_rows = CACHED_FEW_ROWS if sum(weights.values()) <= last_level_cache_bytes() else FEW_ROWS
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, few_rows))
