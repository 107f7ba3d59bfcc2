"""Merging attention computed over disjoint shards of the same context.

Where a request's KV is split across ranks (decode context parallelism: the token at
position x lives on rank x mod C), each rank attends over its own shard and returns,
beside its output, the log-sum-exp of its scores per query and head. The whole
context's softmax is then exact: each shard's output is weighted by exp(lse_shard -
lse_total). A shard that holds none of a request's positions has lse = -inf and weight
0; if every shard is empty the output is 0, never NaN.
"""

from __future__ import annotations

import torch


def merge_attention_shards(outputs: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """outputs [S, T, H, D] (each shard's softmax-weighted values), lse [S, T, H] (its
    log-sum-exp of scaled scores, -inf where it saw nothing) -> [T, H, D], the attention
    over the union of the shards' contexts."""
    total = torch.logsumexp(lse, dim=0)  # [T, H]; -inf where every shard is empty
    weights = torch.exp(lse - total.masked_fill(total.isneginf(), 0.0))  # exp(-inf) = 0
    return (weights.unsqueeze(-1) * outputs.nan_to_num(0.0)).sum(dim=0).to(outputs.dtype)
