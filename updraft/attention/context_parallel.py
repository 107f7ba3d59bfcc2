"""Attention when the context is split over ranks.

Prefill context parallelism (PCP): each rank of a group runs its own chunks of the
step's long prefills. Before attending, every rank's K/V of the step is all-gathered
and written at its global slots, so each rank's cache holds the whole context and its
chunks attend to it as chunked-prefill continuations.

Decode context parallelism (DCP): the C ranks of a group keep the same KV heads, and
each stores every C-th position: the token whose global slot is s (position x, block
b, of ``C * block_size`` positions per block) lives on rank s mod C at local slot
s div C, which is position x div C's place in the same block of ``block_size`` local
slots. Every rank attends with the whole group's query heads over its own positions,
returning the log-sum-exp beside the output, and each rank then merges its own heads'
shards exactly (``merge.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from updraft.attention.in_place import IN_PLACE_MAX_QUERY, reads_cache_in_place
from updraft.attention.merge import merge_attention_shards
from updraft.attention.metadata import AttentionGroup, AttentionMetadata
from updraft.parallel import collectives  # noqa: F401 (registers the collective ops)
from updraft.parallel.topology import GroupRank


def gather_step_rows(
    rows: torch.Tensor, metadata: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache rows, slots) of every rank's tokens of the step under PCP; else this
    rank's own."""
    context = metadata.prefill_context
    if context is None:
        return rows, metadata.slot_mapping
    gathered = torch.ops.updraft.all_gather(rows, context.group, context.size)
    return gathered, context.kv_slot_mapping


def gather_step_kv(
    key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, values, slots) of every rank's tokens of the step under PCP, in one
    all-gather; else this rank's own."""
    if metadata.prefill_context is None:
        return key, value, metadata.slot_mapping
    both, slots = gather_step_rows(torch.cat([key, value], dim=1), metadata)
    keys, values = both.split([key.shape[1], value.shape[1]], dim=1)
    return keys, values, slots


def shard_slots(slot_mapping: torch.Tensor, rank: GroupRank) -> torch.Tensor:
    """Global slots -> this rank's local slots under DCP; -1 where another rank keeps
    the position (and where no one does)."""
    mine = (slot_mapping >= 0) & (slot_mapping.remainder(rank.size) == rank.rank)
    return torch.where(mine, slot_mapping.div(rank.size, rounding_mode="floor"), -1)


def attend_shard(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    rank: int,
    shards: int,
    latent: tuple[int, int] | None = None,
) -> torch.Tensor:
    """query [T, H, D] over this rank's positions of each context -> [T, H * Dv + H]:
    the float32 output and log-sum-exp of every token and head (0 and a log-sum-exp of
    -inf, or -1e30 from the kernel, where the shard holds none of a token's context).
    ``latent`` (key width, value width): the cache is MLA's latent rows [slots, C],
    read as one KV head whose key and value are a row's first columns.

    Decodes and verify steps read the shard in place with the CPU kernel, each query
    token over the positions of its causal context this rank keeps: the first
    ceil((n - r) / C) of its local slots, for a context of n positions."""
    value_dim = query.shape[2] if latent is None else latent[1]
    outputs = []
    for index, shape in enumerate(metadata.shapes):
        if shape.max_query <= IN_PLACE_MAX_QUERY and reads_cache_in_place(query):
            block_table, seq_lens = metadata.in_place_rows(index)
            local = (seq_lens - rank + shards - 1).div(shards, rounding_mode="floor").clamp(min=0)
            tokens, block_size = query[shape.first_token : shape.last_token], metadata.block_size
            if latent is None:
                out, lse = torch.ops.updraft.paged_decode_attention_lse(
                    tokens, kv_cache, block_table, local, block_size // shards, scale
                )
            else:
                out, lse = torch.ops.updraft.paged_latent_attention_lse(
                    tokens, kv_cache, block_table, local, block_size // shards, scale, value_dim
                )
            outputs.append(torch.cat([out.flatten(1), lse], dim=1))
            continue
        group = metadata.shard_group(index, rank, shards)
        slots = group.kv_slots.flatten()
        if latent is None:
            keys = kv_cache[0].index_select(0, slots)
            values = kv_cache[1].index_select(0, slots)
        else:
            keys, values = latent_context(kv_cache, slots, *latent)
        out, lse = attend_with_lse(query, keys, values, group, scale)
        outputs.append(torch.cat([out[..., :value_dim].flatten(1), lse], dim=1))
    return with_padding(outputs, query, metadata.num_padding_tokens, value_dim)


def latent_context(
    cache: torch.Tensor, slots: torch.Tensor, key_width: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows at ``slots`` as one KV head: keys [N, 1, key_width] and values, the
    rows' first ``value_dim`` columns, padded to the keys' width (the fused kernel
    wants one head size; the caller keeps the first ``value_dim`` of the output)."""
    rows = cache.index_select(0, slots)[:, None]
    return rows[..., :key_width], F.pad(rows[..., :value_dim], (0, key_width - value_dim))


def with_padding(
    outputs: list[torch.Tensor], query: torch.Tensor, count: int, value_dim: int
) -> torch.Tensor:
    """The groups' shard results, then ``count`` padding tokens that saw nothing:
    output 0, log-sum-exp -inf."""
    if count:
        heads = query.shape[1]
        padding = query.new_zeros(count, heads * value_dim + heads, dtype=torch.float32)
        padding[:, -heads:] = float("-inf")
        outputs = [*outputs, padding]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def attend_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of the group's tokens, in float32, with its log-sum-exp:
    (out [t, H, D], lse [t, H]). ``mask`` [B, 1, Qmax, Kmax] replaces the group's."""
    mask = group.mask if mask is None else mask
    q, k, v = (x.float() for x in group.batched(query, keys, values))
    if k.shape[1] != q.shape[1]:  # grouped-query heads read their KV head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    no_context = ~mask.any(dim=-1)  # [B, 1, L]: a token this shard holds none of
    if q.device.type == "cpu":
        # The fused CPU kernel returns the log-sum-exp beside the output, in blocks,
        # without the [B, H, L, K] scores a long prefill chunk would spill to memory.
        # (An aten op, the one SDPA itself dispatches to here; its name is underscored.)
        bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # noqa: SLF001
        out, lse = flash(q, k, v, attn_mask=bias, scale=scale)
    else:
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, L]
        out = torch.exp(scores - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1)) @ v
    out = out.masked_fill(no_context.unsqueeze(-1), 0.0)
    lse = lse.masked_fill(no_context, float("-inf"))
    rows = group.output_index
    return (
        out.transpose(1, 2).flatten(0, 1).index_select(0, rows),
        lse.transpose(1, 2).flatten(0, 1).index_select(0, rows),
    )


def merge_own_heads(shards: torch.Tensor, rank: GroupRank, heads: int, dim: int) -> torch.Tensor:
    """Every rank's ``attend_shard`` output, gathered along the last dim
    [T, C * (C * heads * dim + C * heads)] -> this rank's ``heads`` merged over the
    shards, [T, heads * dim]."""
    size, tokens = rank.size, shards.shape[0]
    width = size * heads * dim
    parts = shards.view(tokens, size, width + size * heads)
    outs = parts[..., :width].reshape(tokens, size, size, heads, dim)[:, :, rank.rank]
    lse = parts[..., width:].reshape(tokens, size, size, heads)[:, :, rank.rank]
    return merge_attention_shards(outs.transpose(0, 1), lse.transpose(0, 1)).flatten(1)
