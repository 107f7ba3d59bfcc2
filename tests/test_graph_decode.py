"""A decode step captured with the recorded backend replays exactly like eager, and a
skipped refresh of any declared input shows up in its output."""

from __future__ import annotations

import pytest
import torch

from updraft import LLM, SamplingParams
from updraft.attention.metadata import AttentionMetadata
from updraft.runner.captured import CapturedSteps

BUCKET = 4  # decode requests per captured step


def run(
    tiny_llama, skip: str | None = None, compile_runs: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Decode 3 requests for 8 steps; before the engine runs each decode step, it is run
    both eagerly and by replay of a separately captured graph (its runs of ops compiled
    or not), each from the same KV cache. Returns both logits sequences."""
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=4, enforce_eager=True)
    engine = llm.engine
    runner = engine._runner
    captured = CapturedSteps(
        runner.model, runner.kv_caches, 4, 16, [BUCKET], runner.device, compile_runs=compile_runs
    )
    graph, (_, graph_logits) = captured.graphs[BUCKET, 1]
    if skip is not None:
        (forgotten,) = [i for i in graph.inputs if i.name == skip]
        # A path that forgets one refresh (StaticInput is frozen, hence object.__setattr__).
        object.__setattr__(forgotten, "refresh", lambda values: None)
    eager_all, graph_all = [], []
    execute = runner.execute

    def both_then_execute(inputs):
        if inputs.num_decodes == inputs.num_reqs:
            saved = [cache.clone() for cache in runner.kv_caches]
            with torch.inference_mode():
                metadata = AttentionMetadata.from_step(inputs, 4, "cpu")
                hidden = runner.model(
                    inputs.input_ids, inputs.positions, runner.kv_caches, metadata
                )
                eager_all.append(runner.model.compute_logits(hidden))
                for cache, before in zip(runner.kv_caches, saved, strict=True):
                    cache.copy_(before)
                graph.replay(inputs)
                graph_all.append(graph_logits[: inputs.num_reqs].clone())
                for cache, before in zip(runner.kv_caches, saved, strict=True):
                    cache.copy_(before)
        return execute(inputs)

    runner.execute = both_then_execute
    prompts = ([1, 2, 3, 4, 5], [6, 7], list(range(20, 31)))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert len(eager_all) == 8
    return eager_all, graph_all


@pytest.mark.parametrize("compile_runs", [False, True], ids=["op by op", "compiled"])
def test_replayed_decode_steps_equal_eager(tiny_llama, compile_runs):
    eager, replayed = run(tiny_llama, compile_runs=compile_runs)
    for e, g in zip(eager, replayed, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


@pytest.mark.parametrize("compile_runs", [False, True], ids=["op by op", "compiled"])
@pytest.mark.parametrize("skip", ["block_table", "slot_mapping", "seq_lens", "positions"])
def test_skipping_one_refresh_makes_outputs_diverge(tiny_llama, skip, compile_runs):
    eager, replayed = run(tiny_llama, skip=skip, compile_runs=compile_runs)
    worst = max((g - e).abs().max().item() for e, g in zip(eager, replayed, strict=True))
    assert worst > 1e-2, f"skipping the {skip} refresh went unnoticed"
