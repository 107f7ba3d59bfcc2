"""A decode step captured with the recorded backend replays exactly like eager, and a
skipped refresh of any declared input shows up in its output."""

from __future__ import annotations

import pytest
import torch

from updraft import LLM, SamplingParams
from updraft.attention.metadata import AttentionMetadata, group_shapes
from updraft.graph.recorded import RecordedGraph
from updraft.graph.static_input import StaticInput
from updraft.graph.updatable import UpdatableGraph
from updraft.runner.step import PAD_BLOCK, PAD_POSITION, PAD_SLOT, Step, decodes_first, pad_step

BUCKET = 4  # decode requests per captured step
MAX_BLOCKS = 16


def decode_graph(llm: LLM, capture_step: Step) -> tuple[UpdatableGraph, dict, torch.Tensor]:
    runner = llm.engine.runner
    model = runner.model
    inputs = {
        "input_ids": StaticInput(
            "input_ids", torch.zeros(BUCKET, dtype=torch.long), lambda s: s.input_ids, 0
        ),
        "positions": StaticInput(
            "positions", torch.zeros(BUCKET, dtype=torch.long), lambda s: s.positions, PAD_POSITION
        ),
        "slot_mapping": StaticInput(
            "slot_mapping",
            torch.zeros(BUCKET, dtype=torch.long),
            lambda s: s.slot_mapping,
            PAD_SLOT,
        ),
        "block_table": StaticInput(
            "block_table",
            torch.zeros(BUCKET, MAX_BLOCKS, dtype=torch.long),
            lambda s: s.block_table,
            PAD_BLOCK,
        ),
        "seq_lens": StaticInput(
            "seq_lens", torch.zeros(BUCKET, dtype=torch.long), lambda s: torch.tensor(s.seq_lens), 0
        ),
        "query_start_loc": StaticInput(
            "query_start_loc",
            torch.zeros(BUCKET + 1, dtype=torch.long),
            lambda s: torch.tensor(s.query_start_loc),
            0,
        ),
    }

    def metadata(step: Step) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=inputs["slot_mapping"].buffer,
            block_table=inputs["block_table"].buffer,
            seq_lens=inputs["seq_lens"].buffer,
            query_start_loc=inputs["query_start_loc"].buffer,
            shapes=group_shapes(step),
            block_size=llm.engine.config.block_size,
            num_padding_tokens=step.num_tokens - step.query_start_loc[-1],
        )

    backend = RecordedGraph(
        constants=[*model.parameters(), *model.buffers()],
        persistent=[*runner.kv_caches, *(i.buffer for i in inputs.values())],
        module_names={id(m): name or "model" for name, m in model.named_modules()},
    )
    graph = UpdatableGraph(backend, list(inputs.values()), metadata)

    def forward() -> torch.Tensor:
        hidden = model(
            inputs["input_ids"].buffer,
            inputs["positions"].buffer,
            runner.kv_caches,
            metadata(capture_step),
        )
        return model.compute_logits(hidden)

    with torch.inference_mode():
        logits = graph.capture(forward, capture_step)
    return graph, inputs, logits


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
    scheduler_output, step = next_decode_step(llm)
    graph, inputs, graph_logits = decode_graph(llm, pad_step(step, BUCKET, BUCKET))
    if skip is not None:
        # A path that forgets one refresh (StaticInput is frozen, hence object.__setattr__).
        object.__setattr__(inputs[skip], "refresh", lambda values: None)
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
