"""A decode step captured with the recorded backend replays exactly like eager, and a
skipped refresh of any declared input shows up in its output."""

from __future__ import annotations

import pytest
import torch

from updraft import LLM, SamplingParams
from updraft.attention.metadata import AttentionMetadata
from updraft.runner.captured import CapturedSteps
from updraft.runner.step import Step, decodes_first, pad_step

BUCKET = 4  # decode requests per captured step


def next_decode_step(llm: LLM):
    scheduler_output = llm.engine.scheduler.schedule()
    scheduler_output.scheduled = decodes_first(scheduler_output.scheduled)
    step = Step.build(scheduler_output.scheduled, llm.engine.config.block_size)
    return scheduler_output, step


def run(tiny_llama, skip: str | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Decode 3 requests for 8 steps, each step both eagerly and by replay on copies of
    the KV cache; returns both logits sequences."""
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=4)
    engine = llm.engine
    for prompt in ([1, 2, 3, 4, 5], [6, 7], list(range(20, 31))):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # the prefill runs eagerly
    runner = engine.runner
    captured = CapturedSteps(runner.model, runner.kv_caches, 4, 16, [BUCKET], runner.device)
    graph, graph_logits = captured.graphs[BUCKET, 1]
    if skip is not None:
        (forgotten,) = [i for i in graph.inputs if i.name == skip]
        # A path that forgets one refresh (StaticInput is frozen, hence object.__setattr__).
        object.__setattr__(forgotten, "refresh", lambda values: None)
    scheduler_output, step = next_decode_step(llm)
    eager_all, graph_all = [], []
    for _ in range(8):
        saved = [cache.clone() for cache in runner.kv_caches]
        with torch.inference_mode():
            eager = runner.model.compute_logits(
                runner.model(
                    step.input_ids,
                    step.positions,
                    runner.kv_caches,
                    AttentionMetadata.from_step(step, 4, "cpu"),
                )
            )
        for cache, before in zip(runner.kv_caches, saved, strict=True):
            cache.copy_(before)
        with torch.inference_mode():
            graph.replay(pad_step(step, BUCKET, BUCKET))
        eager_all.append(eager)
        graph_all.append(graph_logits[: step.num_reqs].clone())
        for request in engine.scheduler.update(scheduler_output):
            request.token_ids.append(
                int(eager[step.request_ids.index(request.request_id)].argmax())
            )
        scheduler_output, step = next_decode_step(llm)
    return eager_all, graph_all


def test_replayed_decode_steps_equal_eager(tiny_llama):
    eager, replayed = run(tiny_llama)
    for e, g in zip(eager, replayed, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


@pytest.mark.parametrize("skip", ["block_table", "slot_mapping", "seq_lens", "positions"])
def test_skipping_one_refresh_makes_outputs_diverge(tiny_llama, skip):
    eager, replayed = run(tiny_llama, skip=skip)
    worst = max((g - e).abs().max().item() for e, g in zip(eager, replayed, strict=True))
    assert worst > 1e-2, f"skipping the {skip} refresh went unnoticed"
