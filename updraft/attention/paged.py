"""Paged attention over a slot-addressed KV cache, in plain PyTorch.

A layer's cache is one tensor [2, num_slots + 1, num_kv_heads, head_dim]: slot
``block * block_size + offset`` holds one position. The extra last slot absorbs writes
to slot -1, which is how padded tokens write nothing without a branch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from updraft.attention.metadata import AttentionMetadata


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    shape = (2, num_blocks * block_size + 1, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D] -> [T, H * D].

    Writes this step's key/value into their slots, then attends each group of requests
    to its whole context read back through the block table.
    """
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    key_cache[metadata.slot_mapping] = key
    value_cache[metadata.slot_mapping] = value
    outputs = []
    for group in metadata.groups:
        q = query[group.query_index].transpose(1, 2)  # [B, H, Qmax, D]
        k = key_cache[group.kv_slots].transpose(1, 2)  # [B, Hkv, Kmax, D]
        v = value_cache[group.kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        outputs.append(out.transpose(1, 2).flatten(0, 1)[group.output_index])
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.flatten(1)
