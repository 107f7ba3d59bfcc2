"""Multi-head latent attention (MLA) over a paged latent cache, with DeepSeek sparse
attention (DSA) when the model has an indexer.

A layer's cache is [num_slots + 1, kv_lora_rank + qk_rope_head_dim (+ index_head_dim)]:
per token the normalised latent ``c_kv``, the rotated shared key ``k_pe`` and, for DSA,
the indexer's key (``attention/cache_layout.py``). Keys and values are never cached
expanded. Two ways to attend over it, chosen per group of requests like GQA's:

* **Absorbed** (decodes and verify steps, query groups of up to ``IN_PLACE_MAX_QUERY``
  tokens): the key up-projection W_UK folds into the query (q_nope W_UK, per head), so
  each head attends as multi-query attention over ``[c_kv | k_pe]`` with values
  ``c_kv``, and the value up-projection W_UV applies to the result. Per step this reads
  each cached row once, ``kv_lora_rank + qk_rope_head_dim`` values, whatever the heads.
* **Expanded** (prefill chunks): the group's context goes through ``kv_b_proj`` once
  into per-head keys and values, which is cheaper when many query tokens share them.

With DSA, the indexer scores every context token for every query token (a weighted sum
over its heads of ReLU'd dot products with the cached indexer keys), and each query
attends only to the ``index_topk`` best of its causal context: the selection is a mask
derived inside the step from the cache and the step's own seq_lens and block table, so
a replay selects afresh like everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from updraft.attention.context_parallel import (
    attend_shard,
    attend_with_lse,
    latent_context,
    with_padding,
)
from updraft.attention.in_place import IN_PLACE_MAX_QUERY, reads_cache_in_place
from updraft.attention.metadata import AttentionGroup, AttentionMetadata
from updraft.attention.paged import (
    AttentionParams,
    attend_gathered,
    attend_over_shards,
    attention_op,
)
from updraft.parallel.topology import GroupRank


@dataclass(frozen=True)
class LatentDims:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_head_dim: int = 0  # 0: no indexer (dense attention)
    index_topk: int = 0

    def up_projections(
        self, kv_b_weight: torch.Tensor, heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's rows, per head the key's nope part then the value, as W_UK
        [H, nope, L] and W_UV [H, v, L]."""
        up = kv_b_weight.view(heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = up.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        return w_uk, w_uv

    @property
    def key_width(self) -> int:
        """The columns of a cached row that keys are made of: ``c_kv`` then ``k_pe``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class Selection(NamedTuple):
    """DSA's choice for one group: per query row of the padded group [B, Qmax], context
    indices best first [B, Qmax, k], of which the first ``count`` are chosen (the rest
    are positions outside the causal context, which sort last)."""

    chosen: torch.Tensor
    count: torch.Tensor

    def mask(self, max_context: int) -> torch.Tensor:
        """[B, 1, Qmax, Kmax]: True where a query attends."""
        ranks = torch.arange(self.chosen.shape[-1], device=self.chosen.device)
        keep = ranks < self.count[..., None]
        empty = torch.zeros(
            *self.chosen.shape[:-1], max_context, dtype=torch.bool, device=keep.device
        )
        return empty.scatter(-1, self.chosen, keep)[:, None]

    def token_rows(self, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query token of the group, in order: the slots of its chosen context as a
        block table of one-slot blocks [t, k], and how many there are [t]."""
        batch, max_query, k = self.chosen.shape
        slots = group.kv_slots.gather(1, self.chosen.view(batch, max_query * k))
        table = slots.view(batch * max_query, k).index_select(0, group.output_index)
        return table, self.count.flatten().index_select(0, group.output_index)


def write_latent(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows [T, width] into their slots; slot -1 lands in the spare last slot."""
    cache.index_copy_(0, slot_mapping.remainder(cache.shape[0]), rows)


def latent_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    dims: LatentDims,
    scale: float,
    params: AttentionParams,
    index_query: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, rope] (rotated) -> [T, H * v_head_dim]; with
    DSA, the indexer's queries [T, index_heads, index_head_dim] and head weights
    [T, index_heads]. The attention is a task: its group shapes change every step. Its
    tensors are direct arguments, where capture sees them (a tensor inside some other
    object would not be tracked as one the task reads)."""
    kwargs = {
        "q_nope": q_nope,
        "q_pe": q_pe,
        "cache": cache,
        "metadata": metadata,
        "kv_b_weight": kv_b_weight,
        "dims": dims,
        "scale": scale,
        "index_query": index_query,
        "index_weights": index_weights,
    }
    return attention_op(attend_latent, kwargs, params, metadata)


def sharded_latent_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    dims: LatentDims,
    scale: float,
    params: AttentionParams,
    rank: GroupRank,
    index_query: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent attention when this rank's cache keeps every C-th position (decode context
    parallelism), absorbed for every query: the group's queries in latent space are
    all-gathered, each rank attends over its rows returning the log-sum-exp, and each
    merges its own heads over every rank's shard before the value up-projection. With
    DSA, each rank scores its own positions with the indexer and the scores are
    all-gathered, so that every rank takes the same top-k of the whole context and
    attends over the chosen positions it keeps (``attend_sparse_shard``)."""
    heads = q_nope.shape[1]
    w_uk, w_uv = dims.up_projections(kv_b_weight, heads)
    query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_pe], dim=-1)
    if index_query is None:
        op, op_args = attend_shard, {"latent": (dims.key_width, dims.kv_lora_rank)}
    else:
        op = attend_sparse_shard
        op_args = dict(
            index_query=index_query, index_weights=index_weights, dims=dims, group=rank.group
        )
    latent = attend_over_shards(
        query, cache, metadata, scale, params, rank, dims.kv_lora_rank, op, **op_args
    )
    latent = latent.view(query.shape[0], heads, dims.kv_lora_rank).to(query.dtype)
    return torch.einsum("thl,hvl->thv", latent, w_uv).flatten(1)


def attend_sparse_shard(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    rank: int,
    shards: int,
    index_query: torch.Tensor,
    index_weights: torch.Tensor,
    dims: LatentDims,
    group: str,
) -> torch.Tensor:
    """DSA over this rank's shard: ``attend_shard``'s result for a latent cache, each
    query token attending only to the positions of the global top-k that this rank
    keeps. Local position j is global position j * C + rank."""
    outputs = []
    for index in range(len(metadata.shapes)):
        local = metadata.shard_group(index, rank, shards)
        scores = index_scores(index_query, index_weights, kv_cache, local, dims)  # [B, Q, K]
        every = torch.ops.updraft.all_gather(scores[None], group, shards)  # [C, B, Q, K]
        batch, max_query, columns = scores.shape
        totals = every.permute(1, 2, 3, 0).reshape(batch, max_query, columns * shards)
        allowed = totals.isfinite()
        k = min(dims.index_topk, columns * shards)
        chosen = totals.topk(k, dim=-1).indices  # outside the context sorts last
        count = allowed.sum(dim=-1).clamp(max=k)
        keep = torch.arange(k, device=chosen.device) < count[..., None]
        picked = torch.zeros_like(allowed).scatter(-1, chosen, keep)
        mine = picked.view(batch, max_query, columns, shards)[..., rank]
        slots = local.kv_slots.flatten()
        keys, values = latent_context(kv_cache, slots, dims.key_width, dims.kv_lora_rank)
        mask = local.mask & mine[:, None]
        out, lse = attend_with_lse(query, keys, values, local, scale, mask)
        outputs.append(torch.cat([out[..., : dims.kv_lora_rank].flatten(1), lse], dim=1))
    return with_padding(outputs, query, metadata.num_padding_tokens, dims.kv_lora_rank)


def attend_latent(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    dims: LatentDims,
    scale: float,
    index_query: torch.Tensor | None,
    index_weights: torch.Tensor | None,
) -> torch.Tensor:
    heads = q_nope.shape[1]
    w_uk, w_uv = dims.up_projections(kv_b_weight, heads)
    outputs = []
    for index, shape in enumerate(metadata.shapes):
        tokens = slice(shape.first_token, shape.last_token)
        selected = None
        if index_query is not None:
            group = metadata.group(index)
            selected = index_selection(index_query, index_weights, cache, group, dims)
        if shape.max_query <= IN_PLACE_MAX_QUERY:
            # [t, H, nope] x [H, nope, L] -> [t, H, L]: the query in latent space
            q_latent = torch.einsum("thn,hnl->thl", q_nope[tokens], w_uk)
            query = torch.cat([q_latent, q_pe[tokens]], dim=-1)
            latent = _absorbed(query, cache, metadata, index, dims, scale, selected)
            outputs.append(torch.einsum("thl,hvl->thv", latent, w_uv))
        else:
            outputs.append(
                _expanded(
                    q_nope, q_pe, cache, metadata.group(index), kv_b_weight, dims, scale, selected
                )
            )
    if metadata.num_padding_tokens:
        outputs.append(q_nope.new_zeros(metadata.num_padding_tokens, heads, dims.v_head_dim))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.flatten(1)


def _absorbed(
    query: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    index: int,
    dims: LatentDims,
    scale: float,
    selected: Selection | None,
) -> torch.Tensor:
    """query [t, H, L + rope] in latent space -> [t, H, L]: multi-query attention whose
    keys are the cached rows' first L + rope columns and whose values are their first L.
    Where the kernel runs it reads the rows in place: each request's context through its
    block table, or with DSA only each query token's chosen slots."""
    shape = metadata.shapes[index]
    if reads_cache_in_place(query):
        block_size = metadata.block_size
        if selected is not None:
            block_table, seq_lens = selected.token_rows(metadata.group(index))
            block_size = 1
        else:
            block_table, seq_lens = metadata.in_place_rows(index)
        return torch.ops.updraft.paged_latent_attention(
            query, cache, block_table, seq_lens, block_size, scale, dims.kv_lora_rank
        )
    group = metadata.group(index)
    rows = cache.index_select(0, group.kv_slots.flatten())
    keys = rows[:, None, : dims.key_width]
    values = rows[:, None, : dims.kv_lora_rank]
    mask = None if selected is None else selected.mask(group.kv_slots.shape[1])
    return attend_gathered(query, keys, values, group, scale, mask, shape.first_token)


def expand_latent(
    latent: torch.Tensor, kv_b_weight: torch.Tensor, dims: LatentDims
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached ``c_kv`` rows [N, L] -> per-head key nope parts [N, H, nope] and values
    [N, H, v] through kv_b_proj: the prefill path (decode never calls it)."""
    expanded = F.linear(latent, kv_b_weight).view(
        latent.shape[0], -1, dims.qk_nope_head_dim + dims.v_head_dim
    )
    k_nope, values = expanded.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    return k_nope, values


def _expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    group: AttentionGroup,
    kv_b_weight: torch.Tensor,
    dims: LatentDims,
    scale: float,
    selected: Selection | None,
) -> torch.Tensor:
    rows = cache.index_select(0, group.kv_slots.flatten())
    k_nope, values = expand_latent(rows[:, : dims.kv_lora_rank], kv_b_weight, dims)
    k_pe = rows[:, None, dims.kv_lora_rank : dims.key_width].expand(-1, k_nope.shape[1], -1)
    keys = torch.cat([k_nope, k_pe], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1)
    mask = None if selected is None else selected.mask(group.kv_slots.shape[1])
    return attend_gathered(query, keys, values, group, scale, mask)


def index_scores(
    index_query: torch.Tensor,
    index_weights: torch.Tensor,
    cache: torch.Tensor,
    group: AttentionGroup,
    dims: LatentDims,
) -> torch.Tensor:
    """DSA's score of each context position of the group for each query row [B, Q, K]:
    a weighted sum over the indexer's heads of ReLU'd dot products; -inf outside the
    causal context."""
    batch, max_query = group.query_index.shape
    max_context = group.kv_slots.shape[1]
    keys = cache.index_select(0, group.kv_slots.flatten())[:, dims.key_width :]
    keys = keys.reshape(batch, max_context, dims.index_head_dim).float()
    rows = group.query_index.flatten()
    query = index_query.index_select(0, rows).view(batch, max_query, -1, dims.index_head_dim)
    weights = index_weights.index_select(0, rows).view(batch, max_query, -1)
    scores = F.relu(torch.einsum("bqhi,bki->bqhk", query.float(), keys) * dims.index_head_dim**-0.5)
    totals = torch.einsum("bqh,bqhk->bqk", weights.float(), scores)
    return totals.masked_fill(~group.mask[:, 0], float("-inf"))


def index_selection(
    index_query: torch.Tensor,
    index_weights: torch.Tensor,
    cache: torch.Tensor,
    group: AttentionGroup,
    dims: LatentDims,
) -> Selection:
    """DSA: the context tokens each query of the group attends to: its causal context
    where that is at most ``index_topk`` tokens, else the ``index_topk`` tokens of it
    the indexer scores highest."""
    max_context = group.kv_slots.shape[1]
    totals = index_scores(index_query, index_weights, cache, group, dims)
    allowed = group.mask[:, 0]
    k = min(dims.index_topk, max_context)
    chosen = totals.topk(k, dim=-1).indices  # sorted: outside the context comes last
    return Selection(chosen, allowed.sum(dim=-1).clamp(max=k))
