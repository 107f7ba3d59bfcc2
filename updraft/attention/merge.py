"""Merging attention computed over disjoint shards of the same context.

Where a request's KV is split across ranks (decode context parallelism: the token at
position x lives on rank x mod C), each rank attends over its own shard and returns,
beside its output, the log-sum-exp of its scores per query and head. The whole
context's softmax is then exact: each shard's output is weighted by exp(lse_shard -
lse_total). A shard that holds none of a request's positions has lse = -inf and weight
0; if every shard is empty the output is 0, never NaN.

An attention sink (gpt-oss) is one more logit per head in the softmax's denominator,
with no value: a shard whose lse is the sink and whose output is 0. So a context's
attention with lse L becomes, with the sink s, out * exp(L) / (exp(L) + exp(s)) = out *
sigmoid(L - s), from the lse every attention path returns; under DCP, from the merged
lse, once.
"""

from __future__ import annotations

import torch


def merge_attention_shards(
    outputs: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """outputs [S, T, H, D] (each shard's softmax-weighted values), lse [S, T, H] (its
    log-sum-exp of scaled scores, -inf where it saw nothing) -> [T, H, D], the attention
    over the union of the shards' contexts (with each head's sink, ``sinks`` [H])."""
    total = torch.logsumexp(lse, dim=0)  # [T, H]; -inf where every shard is empty
    weights = torch.exp(lse - total.masked_fill(total.isneginf(), 0.0))  # exp(-inf) = 0
    merged = (weights.unsqueeze(-1) * outputs.nan_to_num(0.0)).sum(dim=0)
    return with_sinks(merged, total, sinks).to(outputs.dtype)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """out [T, H, D], the attention over a context whose log-sum-exp is lse [T, H] (-inf
    or -1e30 where it is empty), with each head's sink logit (``sinks`` [H]) in the
    denominator too; ``out`` as it is without sinks. In float32."""
    if sinks is None:
        return out
    return out.float() * torch.sigmoid(lse - sinks.float()).unsqueeze(-1)
