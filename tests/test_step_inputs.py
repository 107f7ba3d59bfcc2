"""``StepInputs.build`` against a plain per-token reference: decodes first, each token's
position and slot through its request's blocks, logits read at the last known token and
at each draft, and nothing read past the blocks a request holds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from updraft.request import Request
from updraft.sampling_params import SamplingParams
from updraft.step.inputs import StepInputs
from updraft.step.plan import Draft, ScheduledRequest, StepPlan

BLOCK_SIZE = 4


@st.composite
def plans(draw) -> StepPlan:
    plan = StepPlan()
    blocks = iter(draw(st.permutations(range(200))))
    for index in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(0, 99), min_size=1, max_size=30))
        request = Request(str(index), None, prompt, SamplingParams())
        request.num_computed_tokens = draw(st.integers(0, len(prompt) - 1))
        num_known = draw(st.integers(1, len(prompt) - request.num_computed_tokens))
        draft = None
        if request.num_computed_tokens == len(prompt) - 1 and draw(st.booleans()):
            draft = Draft(draw(st.lists(st.integers(0, 99), min_size=1, max_size=4)))
        num_new = num_known + (len(draft.token_ids) if draft else 0)
        slack = draw(st.integers(0, 2))
        needed = -(-(request.num_computed_tokens + num_new) // BLOCK_SIZE) + slack
        request.block_ids = [next(blocks) for _ in range(needed)]
        plan.scheduled.append(ScheduledRequest(request, num_new, draft))
    return plan


@settings(max_examples=200, deadline=None)
@given(plans())
def test_build_equals_a_per_token_reference(plan):
    inputs = StepInputs.build(plan, BLOCK_SIZE)
    ordered = [i for i in plan.scheduled if i.num_new_tokens == 1]
    ordered += [i for i in plan.scheduled if i.num_new_tokens != 1]
    assert inputs.request_ids == [i.request.request_id for i in ordered]
    input_ids, positions, slots, logits_indices, offset = [], [], [], [], 0
    for item in ordered:
        request = item.request
        start = request.num_computed_tokens
        known = request.token_ids[start : start + item.num_new_tokens - item.num_drafts]
        tokens = known + (item.draft.token_ids if item.draft else [])
        for i, token in enumerate(tokens):
            position = start + i
            input_ids.append(token)
            positions.append(position)
            block = request.block_ids[position // BLOCK_SIZE]
            slots.append(block * BLOCK_SIZE + position % BLOCK_SIZE)
        offset += len(tokens)
        if item.samples:
            logits_indices.extend(range(offset - 1 - item.num_drafts, offset))
    assert inputs.forward.input_ids.tolist() == input_ids
    assert inputs.forward.positions.tolist() == positions
    assert inputs.forward.slot_mapping.tolist() == slots
    assert inputs.sampling.logits_indices.tolist() == logits_indices
    lengths = [item.num_new_tokens for item in ordered]
    assert inputs.forward.query_lens == lengths
    assert inputs.forward.seq_lens.tolist() == [
        i.request.num_computed_tokens + i.num_new_tokens for i in ordered
    ]
    for row, item in enumerate(ordered):
        held = item.request.block_ids
        assert inputs.forward.block_table[row, : len(held)].tolist() == held
        assert not inputs.forward.block_table[row, len(held) :].any()
    assert inputs.forward.num_decodes == sum(n == 1 for n in lengths)
    sampling = [row for row, item in enumerate(ordered) if item.samples]
    assert inputs.sampling.rows == sampling
    assert inputs.sampling.num_drafts == [ordered[row].num_drafts for row in sampling]
    for row, n in zip(range(len(sampling)), inputs.sampling.num_drafts, strict=True):
        draft = ordered[sampling[row]].draft
        assert inputs.sampling.draft_token_ids[row, :n].tolist() == (
            draft.token_ids if draft else []
        )


def test_a_request_short_of_blocks_is_refused_not_written_elsewhere():
    request = Request("a", None, list(range(9)), SamplingParams())
    request.block_ids = [3, 5]  # 8 slots for 9 tokens
    with pytest.raises(RuntimeError, match="request a has 2 KV blocks, too few"):
        StepInputs.build(StepPlan([ScheduledRequest(request, 9)]), BLOCK_SIZE)


def test_inputs_are_long_host_tensors():
    request = Request("a", None, [1, 2, 3], SamplingParams())
    request.block_ids = [0]
    inputs = StepInputs.build(StepPlan([ScheduledRequest(request, 3)]), BLOCK_SIZE)
    forward = inputs.forward
    for tensor in (forward.input_ids, forward.positions, forward.slot_mapping, forward.block_table):
        assert tensor.dtype == torch.long and tensor.device.type == "cpu"
