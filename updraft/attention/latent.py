"""Multi-head latent attention (MLA) over a paged latent cache, with DeepSeek sparse
attention (DSA) when the model has an indexer.

A layer's cache is [num_slots + 1, kv_lora_rank + qk_rope_head_dim (+ index_head_dim)]:
per token the normalised latent ``c_kv``, the rotated shared key ``k_pe`` and, for DSA,
the indexer's key (``attention/cache_layout.py``). Keys and values are never cached
expanded. Two ways to attend over it, chosen per group of requests like GQA's:

* **Absorbed** (decodes and verify steps, query groups of up to ``IN_PLACE_MAX_QUERY``
  tokens; ``LatentRows``): the key up-projection W_UK folds into the query (q_nope W_UK,
  per head), so each head attends as multi-query attention over ``[c_kv | k_pe]`` with
  values ``c_kv``, and the value up-projection W_UV applies to the result. Per step this
  reads each cached row once, ``kv_lora_rank + qk_rope_head_dim`` values, whatever the
  heads. Under decode context parallelism every group is absorbed: the shards merge in
  latent space, before each rank's own heads' W_UV.
* **Expanded** (prefill chunks; ``LatentCache``): the group's context goes through
  ``kv_b_proj`` once into per-head keys and values, which is cheaper when many query
  tokens share them.

Both are cache readers of the one attention loop (``loop.py``).

With DSA, the indexer scores every context token for every query token (a weighted sum
over its heads of ReLU'd dot products with the cached indexer keys), and each query
attends only to the ``index_topk`` best of its causal context (``IndexerScores``, the
loop's selector): the selection is derived inside the step from the cache and the
step's own seq_lens and block table, so a replay selects afresh like everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from updraft.attention.context_parallel import attention, step_rows
from updraft.attention.in_place import IN_PLACE_MAX_QUERY
from updraft.attention.loop import Attended, InPlaceRows, Selection, attend_padded
from updraft.attention.metadata import AttentionGroup, AttentionMetadata


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


class LatentRows(NamedTuple):
    """The latent cache read in latent space: queries [t, H, L + rope] (q_nope W_UK
    beside q_pe) of the step's tokens from ``first_token`` on, as multi-query attention
    over the rows' first L + rope columns with values their first L -> [t, H, L]."""

    query: torch.Tensor
    cache: torch.Tensor
    dims: LatentDims
    scale: float
    first_token: int = 0

    @property
    def value_dim(self) -> int:
        return self.dims.kv_lora_rank

    def in_place(self, tokens: slice, rows: InPlaceRows, with_lse: bool) -> Attended:
        query = self.query[tokens.start - self.first_token : tokens.stop - self.first_token]
        latent = self.dims.kv_lora_rank
        assert rows.starts is None, "latent attention has no sliding window"
        return torch.ops.updraft.paged_latent_attention(
            query,
            self.cache,
            rows.block_table,
            rows.seq_lens,
            rows.slots_per_block,
            self.scale,
            latent,
            with_lse,
        )

    def gathered(
        self, tokens: slice, group: AttentionGroup, mask: torch.Tensor, with_lse: bool
    ) -> Attended:
        rows = self.cache.index_select(0, group.kv_slots.flatten())[:, None]
        keys, values = rows[..., : self.dims.key_width], rows[..., : self.dims.kv_lora_rank]
        first = self.first_token
        return attend_padded(self.query, keys, values, group, mask, self.scale, with_lse, first)


class LatentCache(NamedTuple):
    """A layer's queries over its latent cache, in the form each group suits: absorbed
    (``LatentRows`` over the group's q_nope W_UK, then W_UV) for decodes and verify
    steps, expanded through ``kv_b_proj`` for prefill chunks -> [T, H, v_head_dim]."""

    query: torch.Tensor  # q_nope [T, H, nope]
    q_pe: torch.Tensor  # [T, H, rope], rotated
    cache: torch.Tensor
    kv_b_weight: torch.Tensor
    dims: LatentDims
    scale: float

    @property
    def value_dim(self) -> int:
        return self.dims.v_head_dim

    def absorbed(self, tokens: slice) -> LatentRows:
        """The group ``tokens``' queries in latent space."""
        w_uk, _ = self.dims.up_projections(self.kv_b_weight, self.query.shape[1])
        q_latent = torch.einsum("thn,hnl->thl", self.query[tokens], w_uk)
        query = torch.cat([q_latent, self.q_pe[tokens]], dim=-1)
        return LatentRows(query, self.cache, self.dims, self.scale, tokens.start)

    def up_projected(self, latent: torch.Tensor) -> torch.Tensor:
        """[t, H, L] -> [t, H, v_head_dim] through W_UV."""
        _, w_uv = self.dims.up_projections(self.kv_b_weight, self.query.shape[1])
        return torch.einsum("thl,hvl->thv", latent, w_uv)

    def in_place(self, tokens: slice, rows: InPlaceRows, with_lse: bool) -> Attended:
        latent, lse = self.absorbed(tokens).in_place(tokens, rows, with_lse)
        return self.up_projected(latent), lse

    def gathered(
        self, tokens: slice, group: AttentionGroup, mask: torch.Tensor, with_lse: bool
    ) -> Attended:
        if group.query_index.shape[1] <= IN_PLACE_MAX_QUERY:  # short, where no kernel runs
            latent, lse = self.absorbed(tokens).gathered(tokens, group, mask, with_lse)
            return self.up_projected(latent), lse
        dims = self.dims
        rows = self.cache.index_select(0, group.kv_slots.flatten())
        k_nope, values = expand_latent(rows[:, : dims.kv_lora_rank], self.kv_b_weight, dims)
        k_pe = rows[:, None, dims.kv_lora_rank : dims.key_width].expand(-1, k_nope.shape[1], -1)
        keys = torch.cat([k_nope, k_pe], dim=-1)
        query = torch.cat([self.query, self.q_pe], dim=-1)
        return attend_padded(query, keys, values, group, mask, self.scale, with_lse)


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


class IndexerScores(NamedTuple):
    """DSA's selector: each query's ``index_topk`` context positions that the indexer
    scores highest (its whole causal context while that is shorter)."""

    index_query: torch.Tensor  # [T, index_heads, index_head_dim]
    index_weights: torch.Tensor  # [T, index_heads]
    cache: torch.Tensor
    dims: LatentDims

    @property
    def topk(self) -> int:
        return self.dims.index_topk

    def scores(self, group: AttentionGroup) -> torch.Tensor:
        """The score of each context position of the group for each query row
        [B, Q, K]: a weighted sum over the indexer's heads of ReLU'd dot products with
        the cached indexer keys; -inf outside the causal context."""
        dims = self.dims
        batch, max_query = group.query_index.shape
        max_context = group.kv_slots.shape[1]
        keys = self.cache.index_select(0, group.kv_slots.flatten())[:, dims.key_width :]
        keys = keys.reshape(batch, max_context, dims.index_head_dim).float()
        rows = group.query_index.flatten()
        query = self.index_query.index_select(0, rows)
        query = query.view(batch, max_query, -1, dims.index_head_dim).float()
        weights = self.index_weights.index_select(0, rows).view(batch, max_query, -1)
        scale = dims.index_head_dim**-0.5
        scores = F.relu(torch.einsum("bqhi,bki->bqhk", query, keys) * scale)
        totals = torch.einsum("bqh,bqhk->bqk", weights.float(), scores)
        return totals.masked_fill(~group.mask[:, 0], float("-inf"))

    def choose(self, group: AttentionGroup) -> Selection:
        return Selection.best(self.scores(group), self.topk)


def write_latent(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows [T, width] into their slots; slot -1 lands in the spare last slot."""
    cache.index_copy_(0, slot_mapping.remainder(cache.shape[0]), rows)


def latent_attention(
    rows: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    dims: LatentDims,
    scale: float,
    layer: str,
    index_query: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows [T, width] (this step's cache rows: ``c_kv``, ``k_pe``, the indexer's key),
    q_nope [T, H, nope], q_pe [T, H, rope] (rotated) -> [T, H * v_head_dim]; with DSA
    the indexer's queries [T, index_heads, index_head_dim] and head weights
    [T, index_heads]. The rows are written as the metadata's context split says, then
    the attention loop reads the cache: absorbed for every group under decode context
    parallelism (the query gathered and the shards merged in latent space), else in the
    form each group suits."""
    slots, rows = step_rows(metadata, rows)
    write_latent(cache, rows, slots)
    selector = (
        None if index_query is None else IndexerScores(index_query, index_weights, cache, dims)
    )
    reader = LatentCache(q_nope, q_pe, cache, kv_b_weight, dims, scale)
    if metadata.context.decode is None:
        return attention(reader, metadata, layer, selector)
    heads = q_nope.shape[1]
    absorbed = reader.absorbed(slice(0, q_nope.shape[0]))
    latent = attention(absorbed, metadata, layer, selector)
    return reader.up_projected(latent.view(-1, heads, dims.kv_lora_rank)).flatten(1)
