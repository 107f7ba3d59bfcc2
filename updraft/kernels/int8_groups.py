"""updraft's own int8 and int4 weights as block types of ``kernels/gguf_int8.c``, for x
rounded to int8: the codes of ``--quantization int8|int4`` and of AWQ, GPTQ and
compressed-tensors W4 linears, in blocks of 32 or 128 values, each with its row's float32
scale (and for int4 its integer zero) of the group the block lies in. Type codes from 1000
(``int8_u4.h``, ``int8_u8.h``), never a ggml type's.

A "file row" here is what the C driver regroups: per block, the scale's four bytes, for
int4 the zero's byte, then the codes (int4: 16 bytes per 32 values, byte j holding value
j in its low nibble and value j + 16 in its high, as Q4_0 lays them out). It exists only
while a weight is grouped at load. Every value is scale * (code - zero), as in the panels
(``kernels/panels.py``): the same numbers, another layout.
"""

from __future__ import annotations

import torch

# (format, values per block) -> type code; code -> (values per block, file bytes per block)
UPDRAFT_TYPES = {("int4", 32): 1000, ("int4", 128): 1001, ("int8", 32): 1002, ("int8", 128): 1003}
UPDRAFT_BLOCKS = {1000: (32, 21), 1001: (128, 69), 1002: (32, 36), 1003: (128, 132)}
# The int4 zeros a checkpoint holds: codes' 0..15, GPTQ's original format's one more.
LARGEST_ZERO = 16
# int4 codes 0..15 stand for -8..7 where a format has no zero points.
INT4_ZERO = 8


def block_type(fmt: str, in_features: int, group: int) -> int | None:
    """The type whose blocks hold a weight of ``in_features`` columns in ``fmt`` ("int8",
    "int4") with a scale per ``group`` columns (the last group may be shorter): blocks
    of 128 where every block lies in one group, else of 32; None where 32 does not
    divide the columns (x is rounded in blocks of 32) or a group."""
    for values in (128, 32):
        if in_features % values == 0 and (group >= in_features or group % values == 0):
            return UPDRAFT_TYPES[(fmt, values)]
    return None


def file_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    code: int,
) -> torch.Tensor:
    """codes [N, K] (int8, or int4's 0..15 as uint8) with scales (and zeros) [N, ceil(K /
    group)] -> the rows [N, K / B * file bytes] of type ``code`` (uint8). Zeros must be
    whole numbers 0..16; None: 0 for int8, 8 for int4."""
    values, size = UPDRAFT_BLOCKS[code]
    n, k = codes.shape
    blocks = k // values
    which = torch.arange(blocks) * values // group  # each block's group
    scale = scales.float()[:, which].contiguous().view(torch.uint8).view(n, blocks, 4)
    parts = [scale]
    if code in (UPDRAFT_TYPES["int4", 32], UPDRAFT_TYPES["int4", 128]):
        zero = torch.full((n, blocks), INT4_ZERO) if zeros is None else zeros[:, which]
        if not torch.equal(zero, zero.round()) or zero.min() < 0 or zero.max() > LARGEST_ZERO:
            raise ValueError(
                f"int4 zero points must be whole numbers 0..{LARGEST_ZERO}; these are "
                f"{zero.min().item()}..{zero.max().item()}"
            )
        parts.append(zero.to(torch.uint8).view(n, blocks, 1))
        nibbles = codes.to(torch.uint8).view(n, k // 32, 2, 16)
        parts.append((nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).view(n, blocks, values // 2))
    else:
        parts.append(codes.to(torch.int8).view(torch.uint8).view(n, blocks, values))
    return torch.cat(parts, dim=2).view(n, blocks * size)


def row_values(rows: torch.Tensor, code: int, k: int) -> torch.Tensor:
    """File rows [N, row bytes] of type ``code`` -> the values [N, k] they stand for, in
    float64, where every scale times code is exact (checks and tests: no kernel reads
    this)."""
    values, size = UPDRAFT_BLOCKS[code]
    n = rows.shape[0]
    blocks = rows.reshape(n, k // values, size)
    scale = blocks[..., :4].contiguous().view(torch.float32).double()  # [N, blocks, 1]
    if size == 4 + values:  # int8
        codes = blocks[..., 4:].contiguous().view(torch.int8).double()
        return (codes * scale).view(n, k)
    zero = blocks[..., 4:5].double()
    nibbles = blocks[..., 5:].reshape(n, k // 32, 16)
    codes = torch.stack([nibbles & 15, nibbles >> 4], dim=2).view(n, k // values, values)
    return ((codes.double() - zero) * scale).view(n, k)
