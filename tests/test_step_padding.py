"""``pad_step`` is the one padding rule: padded tokens and requests are inert."""

from __future__ import annotations

import pytest
import torch

from updraft import LLM, SamplingParams
from updraft.runner.step import PAD_SLOT, Step, decodes_first, pad_step


def scheduled_step(llm: LLM):
    scheduler_output = llm.engine.scheduler.schedule()
    scheduler_output.scheduled = decodes_first(scheduler_output.scheduled)
    return scheduler_output, Step.build(scheduler_output.scheduled, llm.engine.config.block_size)


def test_padded_rows_change_no_logits_and_write_no_kv(tiny_llama):
    llm = LLM(tiny_llama, keep_logits=True, num_kv_blocks=64, block_size=4)
    engine = llm.engine
    for prompt in ([1, 2, 3, 4, 5], [6, 7], list(range(20, 31))):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
    runner = engine.runner
    for _ in range(3):  # a prefill step, then decode steps
        scheduler_output, step = scheduled_step(llm)
        before = [cache.clone() for cache in runner.kv_caches]
        plain = runner.execute(step)
        after_plain = [cache.clone() for cache in runner.kv_caches]
        for cache, saved in zip(runner.kv_caches, before, strict=True):
            cache.copy_(saved)
        padded_step = pad_step(step, step.num_tokens + 5, step.num_reqs + 3)
        padded = runner.execute(padded_step)
        # Other matmul shapes may round differently, hence a tolerance, far below any
        # real difference (a wrong KV write or a padded row leaking in moves logits by ~1).
        torch.testing.assert_close(padded.logits, plain.logits, atol=1e-5, rtol=0)
        for got, expected in zip(runner.kv_caches, after_plain, strict=True):
            # All but the spare slot, which absorbs padded tokens' writes.
            torch.testing.assert_close(got[:, :-1], expected[:, :-1], atol=1e-5, rtol=0)
        for request in engine.scheduler.update(scheduler_output):
            request.token_ids.append(0)  # any next token will do


def test_pad_values():
    step = Step(
        request_ids=["a"],
        input_ids=torch.tensor([5, 6]),
        positions=torch.tensor([3, 4]),
        query_start_loc=[0, 2],
        query_lens=[2],
        seq_lens=[5],
        block_table=torch.tensor([[7, 8]]),
        slot_mapping=torch.tensor([31, 32]),
        logits_indices=torch.tensor([1]),
        num_decodes=0,
        sampling=None,
    )
    padded = pad_step(step, num_tokens=4, num_reqs=3)
    assert padded.input_ids.tolist() == [5, 6, 0, 0]
    assert padded.positions.tolist() == [3, 4, 0, 0]
    assert padded.slot_mapping.tolist() == [31, 32, PAD_SLOT, PAD_SLOT]
    assert padded.query_start_loc == [0, 2, 2, 2]
    assert padded.seq_lens == [5, 0, 0]
    assert padded.block_table.tolist() == [[7, 8], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="cannot pad"):
        pad_step(step, num_tokens=1, num_reqs=1)
