"""Weight-only int8 linear layers for the CPU (``quantization="int8"``).

Each output channel (row) of a weight gets its own scale, max|w| / 127, and is stored as
int8: a quarter of float32's bytes, which is what a decode step reads. Activations stay
float32; the product is ``(x @ q^T) * scale + bias``, computed by updraft's C kernel
(``kernels/linear.c``, the op ``torch.ops.updraft.int8_linear``).

PyTorch's own weight-only int8 op takes its vectorised path only for half-precision
activations on the CPU; with float32 it runs a scalar loop about 10x slower than a
float32 matmul, hence the kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from updraft.kernels.ops import build_int8_linear


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8, scale [N] float32), with
    weight ~= q * scale[:, None]."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        q, scale = quantize_weight(linear.weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.updraft.int8_linear(flat, self.weight_int8, self.scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def can_quantize_int8(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def quantize_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` of ``model`` (after its weights are loaded) by an
    ``Int8Linear``; a weight tied to an embedding stays in float32 for the embedding."""
    build_int8_linear()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
