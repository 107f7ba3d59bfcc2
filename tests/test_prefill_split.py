"""How a step is cut for prefill context parallelism, rank by rank, checked against the
step it came from: every token runs on exactly one rank, each chunk is a chunked-prefill
continuation at its own positions, and the gather order puts everything back."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_step_inputs import BLOCK_SIZE, plans
from updraft.request import Request
from updraft.sampling_params import SamplingParams
from updraft.step.inputs import ForwardInputs, StepInputs
from updraft.step.plan import ScheduledRequest, StepPlan
from updraft.step.prefill_split import split_step, splits


def step_of(*queries: tuple[int, int]) -> ForwardInputs:
    """A step of requests that each compute ``count`` tokens from ``start``."""
    plan = StepPlan()
    for index, (start, count) in enumerate(queries):
        request = Request(str(index), None, list(range(1, start + count + 1)), SamplingParams())
        request.num_computed_tokens = start
        blocks = -(-(start + count) // BLOCK_SIZE)
        request.block_ids = [100 * (index + 1) + b for b in range(blocks)]
        plan.scheduled.append(ScheduledRequest(request, count))
    return StepInputs.build(plan, BLOCK_SIZE).forward


def local_positions(inputs: ForwardInputs, rank: int, size: int, whole: int = 1) -> list[list[int]]:
    """Each sub-query's positions on ``rank``."""
    local = split_step(inputs, rank, size, whole).local
    starts = local.query_starts
    return [local.positions[a:b].tolist() for a, b in pairwise(starts)]


def test_rank_r_takes_chunks_r_and_2p_minus_1_minus_r():
    inputs = step_of((0, 16))
    assert local_positions(inputs, 0, 2) == [[0, 1, 2, 3], [12, 13, 14, 15]]
    assert local_positions(inputs, 1, 2) == [[4, 5, 6, 7], [8, 9, 10, 11]]
    # A continuation of a chunked prefill, over 4 ranks: 8 chunks of 2 from position 5.
    inputs = step_of((5, 16))
    assert local_positions(inputs, 1, 4) == [[7, 8], [17, 18]]
    assert local_positions(inputs, 3, 4) == [[11, 12], [13, 14]]


def test_a_prompt_shorter_than_2p_chunks_and_decodes():
    """3 tokens over 2 ranks: chunks of one token, the last one empty; a decode stays
    whole on rank 0, ahead of its chunks."""
    inputs = step_of((7, 1), (0, 3))
    assert local_positions(inputs, 0, 2) == [[7], [0]]
    assert local_positions(inputs, 1, 2) == [[1], [2]]
    rank0, rank1 = split_step(inputs, 0, 2, 1), split_step(inputs, 1, 2, 1)
    assert rank0.local.seq_lens.tolist() == [8, 1]
    assert rank1.local.seq_lens.tolist() == [2, 3]
    # Without the decode, rank 0 has one token to rank 1's two: it exchanges one row of
    # padding, which writes nothing.
    alone = step_of((0, 3))
    rank0 = split_step(alone, 0, 2, 1)
    assert rank0.local.num_tokens == 2 and rank0.local.query_starts == [0, 1]
    assert rank0.kv_slot_mapping.tolist() == [alone.slot_mapping[0], -1, *alone.slot_mapping[1:]]
    assert not splits(step_of((7, 1), (3, 1)), whole_query_len=1)
    assert not splits(step_of((7, 4)), whole_query_len=4)


@settings(max_examples=150, deadline=None)
@given(plans(), st.integers(2, 4), st.integers(1, 5))
def test_every_token_runs_once_and_the_gather_restores_the_step(plan, size, whole):
    inputs = StepInputs.build(plan, BLOCK_SIZE).forward
    parts = [split_step(inputs, rank, size, whole) for rank in range(size)]
    order = parts[0].order
    for part in parts[1:]:  # every rank derives the same exchange
        assert torch.equal(part.order, order)
        assert torch.equal(part.kv_slot_mapping, parts[0].kv_slot_mapping)
    for name in ("input_ids", "positions", "slot_mapping"):
        gathered = torch.cat([getattr(part.local, name) for part in parts])
        assert torch.equal(gathered[order], getattr(inputs, name)), name
    assert torch.equal(parts[0].kv_slot_mapping[order], inputs.slot_mapping)
    unused = torch.ones(parts[0].kv_slot_mapping.numel(), dtype=torch.bool)
    unused[order] = False
    assert (parts[0].kv_slot_mapping[unused] == -1).all()  # padding writes nothing
    for rank, part in enumerate(parts):
        local = part.local
        for row, (a, b) in enumerate(pairwise(local.query_starts)):
            positions = local.positions[a:b]
            request = part.request_rows[row]
            # A continuation: its context ends at its last token, through its own blocks.
            assert local.seq_lens[row] == positions[-1] + 1
            assert torch.equal(positions, torch.arange(positions[0], positions[-1] + 1))
            assert torch.equal(local.block_table[row], inputs.block_table[request])
            if inputs.query_lens[request] <= whole:
                assert rank == 0 and b - a == inputs.query_lens[request]
        assert (local.slot_mapping[local.query_starts[-1] :] == -1).all()


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_get_a_like_share_of_causal_work(size):
    """Causal attention work of a chunk grows with its position: pairing chunk r with
    chunk 2P-1-r gives every rank the same total, to within a chunk's own square."""
    inputs = step_of((0, 12 * size))
    work = [
        sum(p + 1 for chunk in local_positions(inputs, rank, size) for p in chunk)
        for rank in range(size)
    ]
    assert max(work) - min(work) <= 6**2
