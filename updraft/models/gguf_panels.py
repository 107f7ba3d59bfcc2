"""GGUF blocks whose codes are the panels' own: Q8_0 and Q4_0 are one half scale and 32
codes each, exactly the int8 and int4 panels' groups of 32 (``kernels/panels.py``), so
their codes and scales move into panels value for value (Q4_0's codes 0..15 stand for
-8..7, as the int4 panels' own do), for a linear layer or for stacked experts."""

from __future__ import annotations

import numpy as np
import torch

from updraft.kernels.gguf_ops import BLOCK_TYPES
from updraft.kernels.panels import Panels, pack_codes

# ggml's Q8_0 and Q4_0 -> the panel format that holds their codes and scales as they are
PANEL_FORMATS = {BLOCK_TYPES["Q8_0"]: "int8", BLOCK_TYPES["Q4_0"]: "int4"}


def block_panels(blocks: list[torch.Tensor], fmt: str, k: int) -> Panels:
    """Q8_0 or Q4_0 rows (stacked parts) -> int8 or int4 panels of the same codes with
    groups of 32: a block's half scale is its group's scale."""
    codes, scales = [], []
    for rows in blocks:
        array = rows.numpy().reshape(rows.shape[0], k // 32, -1)
        scales.append(torch.from_numpy(array[..., :2].copy().view(np.float16)[..., 0]).float())
        quants = array[..., 2:]
        if fmt == "int8":
            codes.append(torch.from_numpy(quants.copy().view(np.int8)).reshape(rows.shape[0], k))
        else:  # low nibbles are values 0..15 of a block, high ones 16..31
            both = np.concatenate([quants & 0xF, quants >> 4], axis=-1)
            codes.append(torch.from_numpy(both).reshape(rows.shape[0], k))
    return pack_codes(torch.cat(codes), torch.cat(scales), None, fmt, 32)


def stacked_block_panels(experts: list[list[torch.Tensor]], fmt: str, k: int) -> Panels:
    """Each expert's Q8_0 or Q4_0 rows (its parts, stacked: gate then up) -> stacked
    panels [E, ...], as ``panels.pack_stacked`` lays out float experts."""
    packed = [block_panels(parts, fmt, k) for parts in experts]
    first = packed[0]
    scales = torch.stack([p.scales for p in packed])
    return Panels(
        torch.stack([p.codes for p in packed]),
        scales,
        None,
        first.format,
        first.group,
        first.out_features,
        first.in_features,
    )
