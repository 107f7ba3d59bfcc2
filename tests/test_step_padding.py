"""Padding comes from one table, ``GRAPH_INPUTS``: padded tokens and requests are inert,
and the capture step is nothing but padding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import greedy
from updraft.config import EngineConfig
from updraft.engine.kv_blocks import BlockPool, KVCacheManager
from updraft.engine.scheduler import Scheduler
from updraft.model_config import ModelConfig
from updraft.request import Request
from updraft.runner.runner import Runner, load_runner
from updraft.step.inputs import (
    GRAPH_INPUTS,
    ForwardInputs,
    StepInputs,
    empty_inputs,
    pad_inputs,
)


def runner_and_scheduler(model_dir, **engine_args) -> tuple[Runner, Scheduler]:
    """A runner of a tiny model (blocks of 4) and a scheduler holding three requests."""
    config = EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=4, **engine_args)
    runner = load_runner(ModelConfig.from_dir(model_dir), config, max_model_len=256)
    scheduler = Scheduler(KVCacheManager(BlockPool(64, 4, True)), 64, 1024, max_model_len=256)
    for index, prompt in enumerate(([1, 2, 3, 4, 5], [6, 7], list(range(20, 31)))):
        scheduler.add(Request(str(index), None, prompt, greedy(8)))
    return runner, scheduler


def test_padded_rows_change_no_logits_and_write_no_kv(tiny_llama):
    runner, scheduler = runner_and_scheduler(tiny_llama)
    for _ in range(3):  # a prefill step, then decode steps
        plan = scheduler.schedule()
        inputs = StepInputs.build(plan, 4)
        before = [cache.clone() for cache in runner.kv_caches]
        plain = runner.forward(inputs).logits
        after_plain = [cache.clone() for cache in runner.kv_caches]
        for cache, saved in zip(runner.kv_caches, before, strict=True):
            cache.copy_(saved)
        grown = pad_inputs(inputs.forward, inputs.num_tokens + 5, inputs.num_reqs + 3)
        padded = runner.forward(replace(inputs, forward=grown))
        # Other matmul shapes may round differently, hence a tolerance, far below any
        # real difference (a wrong KV write or a padded row leaking in moves logits by ~1).
        torch.testing.assert_close(padded.logits, plain, atol=1e-5, rtol=0)
        for got, expected in zip(runner.kv_caches, after_plain, strict=True):
            # All but the spare slot, which absorbs padded tokens' writes.
            torch.testing.assert_close(got[:, :-1], expected[:, :-1], atol=1e-5, rtol=0)
        scheduler.update(plan, runner.execute(inputs))


def test_pad_values_follow_the_table():
    step = StepInputs.from_queries([], positions_per_block=4).forward
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
    # What a bucket of 2 requests of 4 tokens is captured over, as its refresh pads it.
    empty = empty_inputs(GRAPH_INPUTS, ForwardInputs, {"blocks": 3})
    assert empty.num_tokens == empty.num_reqs == 0
    step = pad_inputs(empty, num_tokens=8, num_reqs=2)
    assert step.slot_mapping.tolist() == [-1] * 8  # writes no live KV
    assert step.query_start_loc.tolist() == [0, 0, 0]
    assert step.seq_lens.tolist() == [0, 0]
    assert step.block_table.shape == (2, 3)


def test_a_replay_of_nothing_but_padding_resets_every_buffer(tiny_llama):
    """After a real batch, a step of nothing but padding leaves none of that batch in
    the graph's buffers, and the batch replays as before."""
    runner, scheduler = runner_and_scheduler(tiny_llama, capture_sizes=(4,))
    plan = scheduler.schedule()  # the prefill
    scheduler.update(plan, runner.execute(StepInputs.build(plan, 4)))
    decode = StepInputs.build(scheduler.schedule(), 4)
    bucket = runner.captured.bucket_for(decode.forward)
    with torch.inference_mode():  # the decode writes the same KV each time
        first = runner.captured.run(decode.forward, bucket)[1].clone()
        nothing = empty_inputs(GRAPH_INPUTS, ForwardInputs, {"blocks": runner.captured.max_blocks})
        runner.captured.run(nothing, bucket)
        buffers = {name: i.buffer for name, i in runner.captured.graphs[bucket].inputs.items()}
        assert (buffers["slot_mapping"] == -1).all() and (buffers["block_table"] == 0).all()
        assert (buffers["seq_lens"] == 0).all() and (buffers["positions"] == 0).all()
        _, again = runner.captured.run(decode.forward, bucket)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
