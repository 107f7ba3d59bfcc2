"""The int8 KV cache (``--kv-cache-dtype int8``): each head's key or value row of a
slot is kept as int8 codes followed by their scale, a float32 in the row's last 4 bytes.

One scale per token per head row, because that is the unit the decode kernel reads: a
key row's scale multiplies its finished dot product with the query, and a value row's
the position's softmax weight, once each, so a row costs a widening per code and
nothing per group of codes (a scale per 32 values would cost a multiply-add per group
inside the dot product). Kept inside the row, so a row is still one contiguous read,
and the cache of a layer is still one tensor [2, slots, kv_heads, head_dim + 4] of
int8, which every reader of caches (graph capture, the probe, KV-shared layers, a draft
head reading its target's) takes as it is. A head of 256 costs 260 bytes, 0.254x its
float32 row (0.266x at 64).

Symmetric rounding: scale = max |x| * (1 / 127) and code = x * (127 / max |x|) rounded to
the nearest, ties to even, as the kernel's write (``write_kv_int8``) computes it; the
torch functions here are the same arithmetic for caches the kernel does not write (a
GPU's, or where no C compiler builds it) and for the gathered path's reads.
"""

from __future__ import annotations

import torch

from updraft.kernels.attention_ops import INT8_SCALE_BYTES


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> [..., D + 4] int8: the codes, then the row's scale's bytes."""
    x = x.float()
    top = x.abs().amax(dim=-1, keepdim=True)
    scale = top * torch.tensor(1 / 127, dtype=torch.float32)
    inverse = torch.where(top > 1e-30, 127.0 / top, torch.zeros_like(top))
    codes = torch.round(x * inverse).clamp_(-127, 127).to(torch.int8)
    scale_bytes = scale.contiguous().view(torch.int8)  # [..., 4]
    return torch.cat([codes, scale_bytes], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] int8 rows (``quantize_rows``' layout) -> [..., D] in ``dtype``."""
    dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :dim].float() * scale).to(dtype)


def kv_head_dim(cache: torch.Tensor) -> int:
    """The head size of a GQA cache [2, slots, kv_heads, row]: the row, less an int8
    cache's scale bytes."""
    row = cache.shape[-1]
    return row - INT8_SCALE_BYTES if cache.dtype == torch.int8 else row
