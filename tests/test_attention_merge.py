"""Attention over shards of a context, merged by log-sum-exp, equals attention over the
whole context (the exact decode-context-parallel merge)."""

from __future__ import annotations

import torch

from updraft.attention.merge import merge_attention_shards


def shard_attention(q, k, v, positions):
    """Each query's attention over the keys at ``positions`` -> (output, lse); an empty
    shard gives lse -inf and an output of zeros."""
    if len(positions) == 0:
        tokens, heads, dim = q.shape
        return torch.zeros(tokens, heads, dim), torch.full((tokens, heads), float("-inf"))
    scores = torch.einsum("thd,khd->thk", q, k[positions]) * q.shape[-1] ** -0.5
    return torch.einsum("thk,khd->thd", scores.softmax(-1), v[positions]), scores.logsumexp(-1)


def test_interleaved_shards_merge_to_full_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 16), torch.randn(37, 4, 16), torch.randn(37, 4, 16)
    expected, _ = shard_attention(q, k, v, torch.arange(37))
    for shards in (2, 3, 4):
        # position x on shard x mod C, as decode context parallelism lays KV out
        parts = [shard_attention(q, k, v, torch.arange(r, 37, shards)) for r in range(shards)]
        merged = merge_attention_shards(
            torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts])
        )
        torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)


def test_an_empty_shard_contributes_nothing_and_all_empty_is_zero_not_nan():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    expected, _ = shard_attention(q, k, v, torch.arange(3))
    parts = [shard_attention(q, k, v, p) for p in (torch.arange(3), torch.arange(0))]
    outputs, lse = torch.stack([o for o, _ in parts]), torch.stack([x for _, x in parts])
    torch.testing.assert_close(merge_attention_shards(outputs, lse), expected)
    nothing = merge_attention_shards(outputs[1:].repeat(2, 1, 1, 1), lse[1:].repeat(2, 1, 1))
    assert not nothing.isnan().any() and (nothing == 0).all()


def test_large_scores_do_not_overflow():
    q = torch.full((1, 1, 4), 30.0)
    k = torch.full((5, 1, 4), 30.0)
    v = torch.arange(20.0).view(5, 1, 4)
    expected, _ = shard_attention(q, k, v, torch.arange(5))
    parts = [shard_attention(q, k, v, torch.arange(r, 5, 2)) for r in range(2)]
    merged = merge_attention_shards(
        torch.stack([o for o, _ in parts]), torch.stack([x for _, x in parts])
    )
    assert torch.isfinite(merged).all()
    # scores near 1800 keep about 4 significant digits in float32's log-sum-exp
    torch.testing.assert_close(merged, expected, atol=1e-3, rtol=1e-4)
