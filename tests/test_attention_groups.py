"""A captured bucket's attention group (``AttentionGroup.uniform``) against the group
built from the step's own query starts (``AttentionGroup.build``), over the whole
context and over each decode-context shard of it."""

from __future__ import annotations

import pytest
import torch

from updraft.attention.metadata import AttentionGroup, GroupShape

BLOCK = 8  # positions per block: 4 local slots per block on each of two shards
WIDTH = 5  # blocks per request


def bucket(seq_lens: list[int], query_len: int) -> tuple[GroupShape, dict]:
    """A bucket of ``len(seq_lens)`` requests of ``query_len`` tokens each (a request of
    seq_len 0 is padding: its query is empty), each with its own blocks."""
    requests = len(seq_lens)
    lens = [query_len if n else 0 for n in seq_lens]
    starts = torch.zeros(requests + 1, dtype=torch.long)
    starts[1:] = torch.tensor(lens).cumsum(0)
    shape = GroupShape(0, requests, 0, requests * query_len, query_len, WIDTH * BLOCK)
    tensors = {
        "seq_lens": torch.tensor(seq_lens),
        "block_table": torch.randperm(requests * WIDTH).view(requests, WIDTH),
        "query_start_loc": starts,
    }
    return shape, tensors


@pytest.mark.parametrize("shard", [(0, 1), (0, 2), (1, 2)])
def test_a_full_bucket_s_group_is_the_group_of_its_steps(shard):
    torch.manual_seed(0)
    shape, t = bucket([9, 40, 3, 17], query_len=3)
    uniform = AttentionGroup.uniform(shape, t["seq_lens"], t["block_table"], BLOCK, shard)
    built = AttentionGroup.build(
        shape, t["query_start_loc"], t["seq_lens"], t["block_table"], BLOCK, shard
    )
    for name in ("query_index", "kv_slots", "mask", "output_index"):
        assert torch.equal(getattr(uniform, name), getattr(built, name)), name


@pytest.mark.parametrize("shard", [(0, 1), (0, 2), (1, 2)])
def test_a_padded_bucket_s_real_requests_see_their_own_context(shard):
    """Padding requests (seq_len 0) see one slot (a defined softmax no one reads); the
    real ones see what the group of the real requests alone gives them, on each shard
    (the first column of shard 1 is position 1: not in the context of a query at 0)."""
    torch.manual_seed(0)
    shape, t = bucket([1, 12, 0, 0], query_len=1)
    uniform = AttentionGroup.uniform(shape, t["seq_lens"], t["block_table"], BLOCK, shard)
    real = GroupShape(0, 2, 0, 2, 1, WIDTH * BLOCK)
    built = AttentionGroup.build(
        real, t["query_start_loc"][:3], t["seq_lens"][:2], t["block_table"][:2], BLOCK, shard
    )
    assert torch.equal(uniform.kv_slots[:2], built.kv_slots)
    assert torch.equal(uniform.mask[:2], built.mask)
    assert uniform.mask[2:].sum(-1).flatten().tolist() == [1, 1]
    assert uniform.output_index.tolist() == [0, 1, 2, 3]
