"""Attention sinks (one learned logit per query head in each softmax's denominator) in
the one attention loop, against a direct softmax over each query's context with the sink
appended as one more column: decodes and verify rows through the in-place kernel, prefill
chunks gathered, with and without a sliding window; and the decode-context-parallel merge
of shards with sinks. (The model-level paths, graphs and ranks: tests/test_gpt_oss.py.)"""

from __future__ import annotations

import pytest
import torch

from updraft.attention.gqa import paged_attention
from updraft.attention.in_place import reads_cache_in_place
from updraft.attention.merge import merge_attention_shards
from updraft.attention.metadata import AttentionMetadata
from updraft.step.inputs import ForwardInputs

BLOCK = 4
BLOCKS_PER_REQUEST = 12
HEADS, KV_HEADS, DIM = 4, 2, 16
# (context before the step, tokens this step): two decodes, a verify of four drafts,
# a prefill chunk that continues a cached prefix, and a whole prompt.
REQUESTS = [(19, 1), (6, 1), (26, 4), (13, 12), (0, 9)]


def sink_reference(q, k, v, sinks, scale):
    """q [H, D] over k/v [K, H, D] (heads already matched) with each head's sink."""
    scores = torch.einsum("hd,khd->hk", q.float(), k.float()) * scale
    with_sink = torch.cat([scores, sinks.float()[:, None]], dim=1)
    probs = with_sink.softmax(dim=-1)[:, :-1]
    return torch.einsum("hk,khd->hd", probs, v.float())


def step_of(requests):
    positions, slots, seq_lens, starts = [], [], [], [0]
    for index, (cached, count) in enumerate(requests):
        span = range(cached, cached + count)
        positions += span
        slots += [index * BLOCKS_PER_REQUEST * BLOCK + p for p in span]
        seq_lens.append(cached + count)
        starts.append(starts[-1] + count)
    table = [
        list(range(r * BLOCKS_PER_REQUEST, (r + 1) * BLOCKS_PER_REQUEST))
        for r in range(len(requests))
    ]
    return ForwardInputs(
        input_ids=torch.zeros(len(positions), dtype=torch.int64),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor(table),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.tensor(starts),
    )


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window-5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_of_the_loop_adds_each_head_s_sink_to_its_denominator(window, dtype):
    generator = torch.Generator().manual_seed(0)
    slots = len(REQUESTS) * BLOCKS_PER_REQUEST * BLOCK
    keys = torch.randn(
        len(REQUESTS), BLOCKS_PER_REQUEST * BLOCK, KV_HEADS, DIM, generator=generator
    )
    values = torch.randn(keys.shape, generator=generator)
    cache = torch.zeros(2, slots + 1, KV_HEADS, DIM, dtype=dtype)
    for index, (cached, _) in enumerate(REQUESTS):  # what earlier steps wrote
        first = index * BLOCKS_PER_REQUEST * BLOCK
        cache[0, first : first + cached] = keys[index, :cached].to(dtype)
        cache[1, first : first + cached] = values[index, :cached].to(dtype)
    step = step_of(REQUESTS)
    tokens = step.num_tokens
    query = torch.randn(tokens, HEADS, DIM, generator=generator).to(dtype)
    new_keys = torch.cat([keys[i, c : c + n] for i, (c, n) in enumerate(REQUESTS)]).to(dtype)
    new_values = torch.cat([values[i, c : c + n] for i, (c, n) in enumerate(REQUESTS)]).to(dtype)
    sinks = torch.randn(HEADS, generator=generator) * 2
    metadata = AttentionMetadata.from_step(step, BLOCK, "cpu")
    scale = DIM**-0.5
    got = paged_attention(
        query, new_keys, new_values, cache, metadata, scale, "layer", window, sinks.to(dtype)
    ).view(tokens, HEADS, DIM)
    assert got.dtype == dtype
    row, repeat = 0, HEADS // KV_HEADS
    for index, (cached, count) in enumerate(REQUESTS):
        for position in range(cached, cached + count):
            first = 0 if window is None else max(0, position - window + 1)
            k = keys[index, first : position + 1].to(dtype).repeat_interleave(repeat, dim=1)
            v = values[index, first : position + 1].to(dtype).repeat_interleave(repeat, dim=1)
            expected = sink_reference(query[row], k, v, sinks.to(dtype), scale)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[row].float(), expected, atol=tolerance, rtol=0)
            row += 1
    # float32 on the CPU reads decodes and verify rows in place: both paths were tested
    assert reads_cache_in_place(query) == (dtype == torch.float32)


def test_the_shards_merge_with_the_sinks_once_as_the_whole_context_would():
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(3, HEADS, DIM, generator=generator)
    k, v = (torch.randn(21, HEADS, DIM, generator=generator) for _ in range(2))
    sinks = torch.randn(HEADS, generator=generator) * 2
    scale = DIM**-0.5
    outputs, lses = [], []
    for rank in range(2):  # position x on rank x mod 2; rank 1's shard of token 2 empty
        scores = torch.einsum("thd,khd->thk", q, k[rank::2]) * scale
        outputs.append(torch.einsum("thk,khd->thd", scores.softmax(-1), v[rank::2]))
        lses.append(scores.logsumexp(-1))
    outputs[1][2], lses[1][2] = 0.0, float("-inf")
    merged = merge_attention_shards(torch.stack(outputs), torch.stack(lses), sinks)
    for token in range(3):
        seen = torch.arange(21) if token < 2 else torch.arange(0, 21, 2)
        expected = sink_reference(q[token], k[seen], v[seen], sinks, scale)
        torch.testing.assert_close(merged[token], expected, atol=1e-5, rtol=0)
