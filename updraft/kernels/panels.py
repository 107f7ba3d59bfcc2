"""Weights in the panels ``kernels/linear.c`` reads, in each format, and their
quantization.

A weight [N, K] becomes ceil(N / 16) panels, each the transpose of 16 rows ([K][16], zero
past row N), so a thread streams one contiguous run of memory per 16 outputs. The
formats keep a checkpoint's bytes: float32, bfloat16 and float16 as they are; int8 and
int4 as codes with one float32 scale (and for int4 optionally one zero point) per output
row and group of K. A bfloat16 panel holds its K steps in pairs, [ceil(K / 2)][16][2]
(a zero completes an odd K), so that a row's weights at k and k + 1 are the one 32-bit
word a bfloat16 pair dot product takes. Packing a half-precision weight never widens it;
quantizing widens one block of rows at a time, at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from updraft.kernels.ops import CODE_DTYPES, PANEL
from updraft.weights import WeightFormat

FORMAT_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3, "int4": 4}
STORAGE = {name: CODE_DTYPES[code] for name, code in FORMAT_CODES.items()}
# Largest code magnitude of a symmetric format; int4's codes 0..15 stand for -8..7.
SYMMETRIC_MAX = {"int8": 127, "int4": 7}
INT4_ZERO = 8
# Rows quantized at once: bounds the float32 temporaries at load to a few MB.
QUANTIZE_ROWS = 1024


@dataclass(frozen=True)
class Panels:
    """One weight [out_features, in_features] packed: ``codes`` [P, K, 16] (int4: [P, K,
    8] bytes; bfloat16: [P, ceil(K / 2), 16, 2]), and for quantized formats ``scales``
    (and ``zeros``) [P, K / group, 16] float32; stacked experts carry a leading expert
    dimension on each."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    format: str
    group: int  # steps along K per scale; 0 for the float formats
    out_features: int
    in_features: int

    @property
    def code(self) -> int:
        return FORMAT_CODES[self.format]


def group_size(fmt: WeightFormat, in_features: int) -> int:
    """The K steps per scale of ``fmt`` for a weight of ``in_features`` columns (0 for
    the float formats). Where the size does not divide the columns, the last group is
    shorter."""
    if not fmt.quantized:
        return 0
    return min(fmt.group_size or in_features, in_features)


def _to_panels(rows: torch.Tensor) -> torch.Tensor:
    """[N, C, ...] -> [ceil(N / 16), C, 16, ...]: 16 rows at a time, transposed."""
    # Written straight into the panels: a padded copy of the rows first would hold the
    # weight three times at once (its source, the copy, the panels) while it is packed.
    full, extra = divmod(rows.shape[0], PANEL)
    panels = rows.new_empty(full + (extra > 0), rows.shape[1], PANEL, *rows.shape[2:])
    panels[:full] = rows[: full * PANEL].unflatten(0, (full, PANEL)).transpose(1, 2)
    if extra:
        panels[full].zero_()
        panels[full, :, :extra] = rows[full * PANEL :].transpose(0, 1)
    return panels


def _in_pairs(panels: torch.Tensor) -> torch.Tensor:
    """[P, K, 16] -> [P, ceil(K / 2), 16, 2]: steps k and k + 1 of each row side by side."""
    p, k, _ = panels.shape
    padded = F.pad(panels, (0, 0, 0, k % 2))
    return padded.view(p, -1, 2, PANEL).transpose(2, 3).contiguous()


def quantize(
    weight: torch.Tensor, fmt: WeightFormat
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """weight [N, K] -> (codes [N, K] uint8/int8, scales [N, K / group] float32, zeros or
    None) with weight ~= scales * (codes - zero) per group, the error at most half a
    step. Symmetric: zero 0 (int8) or 8 (int4); with ``zero_point`` (int4), each group
    spans [min, max] of its weights in 16 codes."""
    n, k = weight.shape
    group = group_size(fmt, k)
    groups = -(-k // group)
    codes = torch.empty(n, k, dtype=torch.int8 if fmt.name == "int8" else torch.uint8)
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups) if fmt.zero_point else None
    for start in range(0, n, QUANTIZE_ROWS):
        # Zero columns past K fill the last group: they leave its range and scale as they are.
        block = F.pad(weight[start : start + QUANTIZE_ROWS].float(), (0, groups * group - k))
        block = block.view(-1, groups, group)
        rows = slice(start, start + block.shape[0])
        if fmt.zero_point:
            low = block.amin(dim=-1).clamp(max=0)
            high = block.amax(dim=-1).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-12)
            zero = torch.round(-low / scale).clamp(0, 15)
            code = torch.round(block / scale[..., None]) + zero[..., None]
            codes[rows] = code.clamp(0, 15).flatten(1)[:, :k].to(codes.dtype)
            zeros[rows] = zero
        else:
            top = SYMMETRIC_MAX[fmt.name]
            scale = block.abs().amax(dim=-1).clamp(min=1e-12) / top
            code = torch.round(block / scale[..., None]).clamp(-top, top)
            if fmt.name == "int4":
                code = code + INT4_ZERO
            codes[rows] = code.flatten(1)[:, :k].to(codes.dtype)
        scales[rows] = scale
    return codes, scales, zeros


def pack(weight: torch.Tensor, fmt: WeightFormat) -> Panels:
    """weight [N, K] (any float dtype) in panels of ``fmt``."""
    n, k = weight.shape
    if not fmt.quantized:
        codes = _to_panels(weight.detach().to(STORAGE[fmt.name]))
        if fmt.name == "bfloat16":
            codes = _in_pairs(codes)
        return Panels(codes, None, None, fmt.name, 0, n, k)
    codes, scales, zeros = quantize(weight.detach(), fmt)
    return pack_codes(codes, scales, zeros, fmt.name, group_size(fmt, k))


def pack_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fmt: str,
    group: int,
) -> Panels:
    """Quantized codes [N, K] (int8, or int4's 0..15 as uint8) with their scales (and
    zeros) [N, K / group] in panels of ``fmt``: what ``pack`` does after quantizing, and
    what a checkpoint quantized elsewhere is read into."""
    n, k = codes.shape
    codes = _to_panels(codes)
    if fmt == "int4":  # byte j: weight j in the low nibble, weight j + 8 in the high
        codes = codes[..., : PANEL // 2] | (codes[..., PANEL // 2 :] << 4)
    return Panels(
        codes.contiguous(),
        _to_panels(scales),
        None if zeros is None else _to_panels(zeros),
        fmt,
        group,
        n,
        k,
    )


def pack_stacked(weights: torch.Tensor, fmt: WeightFormat) -> Panels:
    """Stacked weights [E, N, K] (every routed expert's), each packed into its slot of
    the stacked panels: one expert's packing at a time exists beside them."""
    first = pack(weights[0], fmt)

    def stacked(part: torch.Tensor | None) -> torch.Tensor | None:
        return None if part is None else part.new_empty(len(weights), *part.shape)

    out = Panels(
        stacked(first.codes),
        stacked(first.scales),
        stacked(first.zeros),
        first.format,
        first.group,
        first.out_features,
        first.in_features,
    )
    for expert, weight in enumerate(weights):
        packed = first if expert == 0 else pack(weight, fmt)
        for name in ("codes", "scales", "zeros"):
            part = getattr(packed, name)
            if part is not None:
                getattr(out, name)[expert] = part
    return out


def unpack(panels: Panels) -> torch.Tensor:
    """The float32 weight [N, K] that ``panels`` stands for (tests and checks only: the
    kernels never make one)."""
    codes = panels.codes
    if panels.format == "int4":
        codes = torch.cat([codes & 0x0F, codes >> 4], dim=-1)
    elif panels.format == "bfloat16":
        codes = codes.transpose(2, 3).reshape(len(codes), -1, PANEL)[:, : panels.in_features]
    rows = codes.transpose(1, 2).reshape(-1, panels.in_features).float()
    if panels.scales is not None:
        zero = INT4_ZERO if panels.format == "int4" else 0
        scales = panels.scales.transpose(1, 2).reshape(rows.shape[0], -1)
        zeros = (
            panels.zeros.transpose(1, 2).reshape(rows.shape[0], -1)
            if panels.zeros is not None
            else torch.full_like(scales, zero)
        )
        k, groups = panels.in_features, scales.shape[1]
        grouped = F.pad(rows, (0, groups * panels.group - k)).view(rows.shape[0], groups, -1)
        rows = ((grouped - zeros[..., None]) * scales[..., None]).flatten(1)[:, :k]
    return rows[: panels.out_features]
