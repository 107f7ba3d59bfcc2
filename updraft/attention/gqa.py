"""Grouped-query attention (GQA, and MHA and MQA) over a paged cache of keys and values.

A GQA layer's cache is one tensor [2, num_slots + 1, num_kv_heads, head_dim]: slot
``block * slots_per_block + offset`` holds one position, keys then values. The extra
last slot absorbs writes to slot -1, which is how padded tokens write nothing without a
branch. The attention loop (``loop.py``) reads it through ``PagedKV``. An int8 cache
(``--kv-cache-dtype int8``) is [2, num_slots + 1, num_kv_heads, head_dim + 4]: each head
row's codes and scale (``kv_int8.py``), quantized as they are written and read in place
by the decode kernel, or dequantized as the gathered path gathers them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from updraft.attention.context_parallel import attention, step_rows
from updraft.attention.kv_int8 import dequantize_rows, kv_head_dim, quantize_rows
from updraft.attention.loop import Attended, InPlaceRows, attend_padded
from updraft.attention.metadata import AttentionGroup, AttentionMetadata
from updraft.kernels.attention_ops import writes_kv_in_one_call


class PagedKV(NamedTuple):
    """A layer's queries [T, H, D] and its cache of keys and values."""

    query: torch.Tensor
    cache: torch.Tensor
    scale: float

    @property
    def value_dim(self) -> int:
        return kv_head_dim(self.cache)

    def in_place(self, tokens: slice, rows: InPlaceRows, with_lse: bool) -> Attended:
        return torch.ops.updraft.paged_decode_attention(
            self.query[tokens],
            self.cache,
            rows.block_table,
            rows.seq_lens,
            rows.slots_per_block,
            self.scale,
            with_lse,
            rows.starts,
        )

    def gathered(
        self, tokens: slice, group: AttentionGroup, mask: torch.Tensor, with_lse: bool
    ) -> Attended:
        slots = group.kv_slots.flatten()
        keys = self.cache[0].index_select(0, slots)
        values = self.cache[1].index_select(0, slots)
        if self.cache.dtype == torch.int8:
            keys = dequantize_rows(keys, self.query.dtype)
            values = dequantize_rows(values, self.query.dtype)
        return attend_padded(self.query, keys, values, group, mask, self.scale, with_lse)


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if writes_kv_in_one_call(kv_cache, key, value):  # one C call, not two ops
        torch.ops.updraft.write_kv(kv_cache, key, value, slot_mapping)
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if kv_cache.dtype == torch.int8:
        key, value = quantize_rows(key), quantize_rows(value)
    # index_copy_ rather than index_put_: the latter takes a slow parallel path on the
    # CPU. remainder() sends slot -1 to the spare last slot.
    write_slots = slot_mapping.remainder(key_cache.shape[0])
    key_cache.index_copy_(0, write_slots, key)
    value_cache.index_copy_(0, write_slots, value)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    layer: str,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D] -> [T, H * D]: the step's keys and values
    written (every prefill-context rank's, or this rank's positions only, as the
    metadata's context split says), then the attention loop over the cache (over each
    query's last ``window`` positions, for a sliding-window layer; with each head's
    sink logit, ``sinks`` [H], where the layer has them)."""
    slots, key, value = step_rows(metadata, key, value, window=window)
    write_kv(kv_cache, key, value, slots)
    reader = PagedKV(query, kv_cache, scale)
    return attention(reader, metadata, layer, window=window, sinks=sinks)
