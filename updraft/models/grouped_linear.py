"""Linear layers of updraft's own int8 and int4 codes (``--quantization int8|int4``, and
AWQ, GPTQ and compressed-tensors W4 linears) under int8 activations: the codes in the
int8 kernel's groups (``kernels/int8_groups.py``, ``kernels/gguf_int8.c``) instead of
the panels, and x rounded to int8 per 32 values, as a GGUF file's grouped linears take
it. One packing per weight: the panels are not also made.

A weight whose columns are not a whole number of 32-value blocks (or whose groups are
not) cannot be laid out so; it keeps the panels and float32 x (``grouped_or_none``
answers None for it).
"""

from __future__ import annotations

import torch
from torch import nn

from updraft.kernels.gguf_ops import INT8_MAX_ROWS, gguf_group, int8_kernel_builds
from updraft.kernels.int8_groups import block_type, file_rows
from updraft.kernels.panels import group_size, quantize
from updraft.weights import WeightFormat


class GroupedLinear(nn.Module):
    """y = round(x) W^T (+ bias), W's rows in groups of eight of type ``code`` (one of
    ``int8_groups.UPDRAFT_TYPES``), x rounded to int8 per 32 values."""

    def __init__(
        self,
        groups: torch.Tensor,
        code: int,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        fmt: WeightFormat,
    ) -> None:
        super().__init__()
        self.register_buffer("groups", groups, persistent=False)
        self.code = code
        self.in_features = in_features
        self.out_features = out_features
        self.format = fmt
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # a decode step: one pass over the groups; a prefill or a batched step: integer
        # tiles, each group reused by all of x's rows (row for row the same sums)
        op = (
            torch.ops.updraft.gguf_linear_int8
            if flat.shape[0] <= INT8_MAX_ROWS
            else torch.ops.updraft.gguf_gemm_int8
        )
        out = op(flat, self.groups, self.bias, self.code, self.in_features, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.format}, int8 x"
        )


def grouped_or_none(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fmt: WeightFormat,
    group: int,
    bias: torch.Tensor | None,
) -> GroupedLinear | None:
    """A ``GroupedLinear`` over quantized codes [N, K] (int8, or int4's 0..15 as uint8)
    with their scales (and zeros) per row and ``group`` columns, as ``pack_codes`` takes
    them; None where their columns do not fit the kernel's blocks or it does not build."""
    n, k = codes.shape
    code = block_type(fmt.name, k, group)
    if code is None or not int8_kernel_builds():
        return None
    groups = gguf_group(file_rows(codes, scales, zeros, group, code), code, k)
    return GroupedLinear(groups, code, k, n, bias, fmt)


def fits(linear: nn.Linear, fmt: WeightFormat) -> bool:
    """Whether ``linear`` quantized to ``fmt`` can be a ``GroupedLinear``."""
    k = linear.in_features
    return block_type(fmt.name, k, group_size(fmt, k)) is not None and int8_kernel_builds()


def quantized_grouped(linear: nn.Linear, fmt: WeightFormat) -> GroupedLinear | None:
    """``linear`` quantized to ``fmt`` (int8 or int4) and grouped, or None where it does
    not fit (``fits``)."""
    if not fits(linear, fmt):
        return None
    codes, scales, zeros = quantize(linear.weight.detach(), fmt)
    group = group_size(fmt, linear.in_features)
    return grouped_or_none(codes, scales, zeros, fmt, group, linear.bias)
