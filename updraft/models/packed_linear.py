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
        # Reordered for one row at a time, a decode step's shape; other batch sizes
        # run on the same layout.
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
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
