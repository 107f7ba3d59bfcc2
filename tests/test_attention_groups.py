"""A captured bucket's attention group (``AttentionGroup.uniform``) against the group
built from the step's own query starts (``AttentionGroup.build``), over the whole
context and over each decode-context shard of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from updraft.attention import metadata
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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), min_size=1, max_size=20))
def test_prompts_are_grouped_so_padding_costs_at_most_half_again(requests):
    """Each group covers the next requests in order; a group of several pads them to at
    most MAX_PADDING times their own work (queries x contexts)."""
    query_lens = [query for query, _ in requests]
    seq_lens = [query + before for query, before in requests]
    ranges = metadata.similar_length_runs(query_lens, seq_lens, 0, len(requests))
    assert [first for first, _ in ranges] == [0] + [last for _, last in ranges[:-1]]
    assert ranges[-1][1] == len(requests)
    for first, last in ranges:
        queries, contexts = query_lens[first:last], seq_lens[first:last]
        own = sum(q * c for q, c in zip(queries, contexts, strict=True))
        padded = (last - first) * max(queries) * max(contexts)
        assert last - first == 1 or padded <= metadata.MAX_PADDING * own


def test_decodes_stay_one_group_and_short_prompts_leave_long_ones():
    query_lens = [1, 1, 1, 16, 256, 250, 20]
    seq_lens = [40, 7, 90, 16, 256, 250, 20]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    step = SimpleNamespace(
        query_lens=query_lens,
        query_starts=starts,
        seq_lens=torch.tensor(seq_lens),
        num_decodes=3,
    )
    shapes = metadata.group_shapes(step)
    assert [(s.first_req, s.last_req) for s in shapes] == [(0, 3), (3, 4), (4, 6), (6, 7)]
    assert [(s.max_query, s.max_context) for s in shapes] == [
        (1, 90),
        (16, 16),
        (256, 256),
        (20, 20),
    ]
    assert shapes[2].first_token == 19 and shapes[2].last_token == 525
