"""Padding comes from one table, ``GRAPH_INPUTS``: padded tokens and requests are inert,
and the capture step is nothing but padding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from updraft import LLM, SamplingParams
from updraft.step.inputs import GRAPH_INPUTS, StepInputs, capture_inputs, pad_inputs


def test_padded_rows_change_no_logits_and_write_no_kv(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=4)
    engine = llm.engine
    for prompt in ([1, 2, 3, 4, 5], [6, 7], list(range(20, 31))):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
    runner = engine._runner
    for _ in range(3):  # a prefill step, then decode steps
        plan = engine._scheduler.schedule()
        inputs = StepInputs.build(plan, engine.config.block_size)
        before = [cache.clone() for cache in runner.kv_caches]
        plain = runner.forward(inputs).logits
        after_plain = [cache.clone() for cache in runner.kv_caches]
        for cache, saved in zip(runner.kv_caches, before, strict=True):
            cache.copy_(saved)
        padded = runner.forward(pad_inputs(inputs, inputs.num_tokens + 5, inputs.num_reqs + 3))
        # Other matmul shapes may round differently, hence a tolerance, far below any
        # real difference (a wrong KV write or a padded row leaking in moves logits by ~1).
        torch.testing.assert_close(padded.logits, plain, atol=1e-5, rtol=0)
        for got, expected in zip(runner.kv_caches, after_plain, strict=True):
            # All but the spare slot, which absorbs padded tokens' writes.
            torch.testing.assert_close(got[:, :-1], expected[:, :-1], atol=1e-5, rtol=0)
        engine._scheduler.update(plan, runner.execute(inputs))


def test_pad_values_follow_the_table():
    step = StepInputs.from_queries([], block_size=4)
    values = {
        "input_ids": torch.tensor([5, 6]),
        "positions": torch.tensor([3, 4]),
        "slot_mapping": torch.tensor([31, 32]),
        "block_table": torch.tensor([[7, 8]]),
        "seq_lens": torch.tensor([5]),
        "query_start_loc": torch.tensor([0, 2]),
    }
    assert {spec.name for spec in GRAPH_INPUTS} == set(values)
    padded = pad_inputs(replace(step, **values), num_tokens=4, num_reqs=3)
    assert padded.input_ids.tolist() == [5, 6, 0, 0]
    assert padded.positions.tolist() == [3, 4, 0, 0]
    assert padded.slot_mapping.tolist() == [31, 32, -1, -1]
    assert padded.query_start_loc.tolist() == [0, 2, 2, 2]
    assert padded.seq_lens.tolist() == [5, 0, 0]
    assert padded.block_table.tolist() == [[7, 8], [0, 0], [0, 0]]
    assert padded.query_lens == [2, 0, 0]
    with pytest.raises(ValueError, match="cannot pad"):
        pad_inputs(padded, num_tokens=1, num_reqs=1)


def test_the_capture_step_is_all_padding():
    step = capture_inputs(num_tokens=8, num_reqs=2, max_blocks=3)
    assert step.slot_mapping.tolist() == [-1] * 8  # writes no live KV
    assert step.query_start_loc.tolist() == [0, 0, 0]
    assert step.seq_lens.tolist() == [0, 0]
    assert step.block_table.shape == (2, 3)
