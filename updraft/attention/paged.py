"""Paged attention over a slot-addressed KV cache, in plain PyTorch.

A GQA layer's cache is one tensor [2, num_slots + 1, num_kv_heads, head_dim]: slot
``block * block_size + offset`` holds one position. The extra last slot absorbs writes
to slot -1, which is how padded tokens write nothing without a branch. Other attention
kinds (``attention/latent.py``) keep other rows per slot (``attention/cache_layout.py``)
and share the allocation and the group and token-row indices of ``metadata``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from updraft.attention.cache_layout import CacheLayout
from updraft.attention.context_parallel import (
    attend_shard,
    gather_step_kv,
    merge_own_heads,
    shard_slots,
)
from updraft.attention.in_place import IN_PLACE_MAX_QUERY, reads_cache_in_place
from updraft.attention.metadata import AttentionGroup, AttentionMetadata
from updraft.graph.tasks import register_task
from updraft.parallel.topology import GroupRank


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    layout: CacheLayout,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    shape = layout.shape(num_blocks * block_size + 1)
    try:
        if torch.device(device).type == "cpu":
            return [zeros_on_first_write(shape, dtype) for _ in range(num_layers)]
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    except (MemoryError, torch.OutOfMemoryError) as error:
        size = num_layers * math.prod(shape) * dtype.itemsize / 2**30
        raise ValueError(
            f"cannot allocate a KV cache of {num_blocks} blocks ({size:.1f} GiB) on {device}: "
            f"{error}; lower kv_cache_memory_gib or num_kv_blocks"
        ) from error


def zeros_on_first_write(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor from calloc'd memory: the OS maps each page on its first write, so
    a large KV budget costs memory only as blocks fill (``torch.zeros`` would write,
    and so map, every byte up front)."""
    numel = math.prod(shape)
    memory = np.zeros(numel * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(memory).view(dtype).view(shape)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, layout: CacheLayout, dtype: torch.dtype
) -> int:
    return num_layers * block_size * layout.values_per_slot * dtype.itemsize


@dataclass(frozen=True)
class AttentionParams:
    """Provider of one attention layer's per-step parameters: the step's metadata, whose
    host-side shapes change every step. Draft steps need no index of their own here:
    each replay resolves from the step it is given, whichever draft step that is."""

    layer: str

    def resolve(self, metadata: AttentionMetadata) -> dict[str, AttentionMetadata]:
        return {"metadata": metadata}


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    # index_copy_ rather than index_put_: the latter takes a slow parallel path on the
    # CPU. remainder() sends slot -1 to the spare last slot.
    write_slots = slot_mapping.remainder(key_cache.shape[0])
    key_cache.index_copy_(0, write_slots, key)
    value_cache.index_copy_(0, write_slots, value)


def attend(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Each group of requests attends to its whole context. query [T, H, D] -> [T, H * D].

    Where updraft's CPU kernel runs (float32 on the CPU), decodes and groups of short
    queries (speculative verify steps) read the paged cache in place, each query token
    as a decode of its own causal context; prefill groups, and everything elsewhere,
    gather their context through the block table into one padded attention call."""
    outputs = []
    for index, shape in enumerate(metadata.shapes):
        if shape.max_query <= IN_PLACE_MAX_QUERY and reads_cache_in_place(query):
            block_table, seq_lens = metadata.in_place_rows(index)
            outputs.append(
                torch.ops.updraft.paged_decode_attention(
                    query[shape.first_token : shape.last_token],
                    kv_cache,
                    block_table,
                    seq_lens,
                    metadata.block_size,
                    scale,
                )
            )
        else:
            outputs.append(gather_and_attend(query, kv_cache, metadata.group(index), scale))
    if metadata.num_padding_tokens:
        outputs.append(query.new_zeros(metadata.num_padding_tokens, *query.shape[1:]))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.flatten(1)


def gather_and_attend(
    query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup, scale: float
) -> torch.Tensor:
    """One padded attention call over the group's context, gathered from the cache."""
    slots = group.kv_slots.flatten()
    keys = kv_cache[0].index_select(0, slots)
    values = kv_cache[1].index_select(0, slots)
    return attend_gathered(query, keys, values, group, scale)


def attend_gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    mask: torch.Tensor | None = None,
    first_token: int = 0,
) -> torch.Tensor:
    """query [tokens, H, D] (the flat batch from ``first_token`` on), the group's context
    keys [B * Kmax, Hkv, D] and values [B * Kmax, Hkv, Dv] -> the group's tokens
    [t, H, Dv]. ``mask`` [B, 1, Qmax, Kmax] replaces the group's causal mask."""
    q, k, v = group.batched(query, keys, values, first_token)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=group.mask if mask is None else mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(1, 2).flatten(0, 1).index_select(0, group.output_index)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    params: AttentionParams,
    decode_context: GroupRank | None = None,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D] -> [T, H * D]. The KV write reads only
    tensors; the attention itself is a task, since its shapes change every step.
    Under context parallelism (``context_parallel.py``) the K/V written are every
    prefill-context rank's, and with ``decode_context`` this rank keeps its positions
    only and merges its heads' attention over every rank's."""
    key, value, slot_mapping = gather_step_kv(key, value, metadata)
    if decode_context is None:
        write_kv(kv_cache, key, value, slot_mapping)
        kwargs = {"query": query, "kv_cache": kv_cache, "metadata": metadata, "scale": scale}
        return attention_op(attend, kwargs, params, metadata)
    write_kv(kv_cache, key, value, shard_slots(slot_mapping, decode_context))
    out = attend_over_shards(
        query, kv_cache, metadata, scale, params, decode_context, query.shape[-1]
    )
    return out.to(query.dtype)


def attend_over_shards(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    params: AttentionParams,
    rank: GroupRank,
    value_dim: int,
    op: Callable[..., torch.Tensor] = attend_shard,
    **op_args: Any,
) -> torch.Tensor:
    """Attention of this rank's heads of query [T, H, D] over a context whose positions
    its decode-context group splits: the group's query heads are all-gathered, ``op``
    (a task) attends with them over this rank's positions returning the log-sum-exp,
    and every rank's results are all-gathered for each rank to merge its own heads
    -> [T, H * value_dim], float32."""
    tokens, heads, width = query.shape
    queries = torch.ops.updraft.all_gather_last(query.flatten(1), rank.group, rank.size)
    kwargs = {
        "query": queries.view(tokens, rank.size * heads, width),
        "kv_cache": kv_cache,
        "metadata": metadata,
        "scale": scale,
        "rank": rank.rank,
        "shards": rank.size,
        **op_args,
    }
    shard = attention_op(op, kwargs, params, metadata)
    gathered = torch.ops.updraft.all_gather_last(shard, rank.group, rank.size)
    return merge_own_heads(gathered, rank, heads, value_dim)


def attention_op(
    op: Callable[..., torch.Tensor],
    kwargs: dict[str, Any],
    params: AttentionParams,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Attention with the step's group shapes is a task, re-resolved at every replay
    (a PIECEWISE graph on CUDA). With a bucket's own shapes (``metadata.uniform``) it has
    no per-step host parameter, so it runs as plain ops a graph holds whole (FULL)."""
    if metadata.uniform:
        return op(**kwargs)
    return register_task(op, kwargs, params)
