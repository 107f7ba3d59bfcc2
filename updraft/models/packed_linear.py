"""Linear layers whose weights oneDNN has laid out for itself, for float32 on the CPU.

PyTorch's default CPU path for a matrix-vector product (a decode step's every
projection) streams a weight at about half the machine's memory bandwidth; oneDNN with a
weight reordered once at load time ("prepacked", as vLLM's CPU backend and inductor's
freezing do) streams it about twice as fast. Decode at batch 1 reads every weight once
per token, so this is most of a decode step.

The reordered weight is an opaque oneDNN tensor: it has no storage to view or copy, and
nothing but ``_linear_pointwise`` reads it.
"""

from __future__ import annotations

import torch
from torch import nn

# The row count oneDNN lays a weight out for. Any count runs on the layout, but one laid
# out for a single row ran 1.2-2x slower from 4 rows up (a batched decode step), while
# one laid out for 16 rows ran a single row as fast (benchmarks/RESULTS.md).
PACKED_FOR_ROWS = 16


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_FOR_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` of ``model`` (after its weights are loaded) by a
    ``PackedLinear``; a weight tied to an embedding stays for the embedding."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child))
