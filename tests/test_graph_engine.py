"""With captured decode steps on, the engine gives eager's logits and greedy tokens, and
reports how each step ran."""

from __future__ import annotations

import pytest
import torch

from tests.probes import LogitsProbe
from updraft import LLM, SamplingParams

PROMPTS = [list(range(3, 10)), [200, 17], list(range(40, 77)), [5] * 9]


@pytest.mark.parametrize("compile_graphs", [False, True], ids=["op by op", "compiled"])
def test_graph_replay_matches_eager_through_the_engine(tiny_checkpoint, compile_graphs):
    kind, model_dir = tiny_checkpoint
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    args = dict(block_size=4, num_kv_blocks=128, capture_sizes=(1, 2, 4))
    eager = LLM(model_dir, enforce_eager=True, **args)
    graph = LLM(model_dir, enforce_eager=False, compile_graphs=compile_graphs, **args)
    eager_probe, graph_probe = LogitsProbe(eager), LogitsProbe(graph)
    # Requests join and leave: different lengths finish at different steps.
    many = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 5, 12, 1)]
    for prompts, sampling in ((PROMPTS, params), (PROMPTS, many), (PROMPTS[:1], params)):
        expected = eager.generate(prompts, sampling)
        got = graph.generate(prompts, sampling)
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, kind
            torch.testing.assert_close(graph_probe.of(g), eager_probe.of(e), atol=1e-5, rtol=0)
    modes = graph.engine.stats().steps
    assert modes["graph"] > 0 and modes["eager (prefill)"] > 0
    assert set(eager.engine.stats().steps) == {"eager (graphs off)"}


def test_buffers_keep_their_address_and_padded_rows_their_pad_values(tiny_llama):
    llm = LLM(tiny_llama, enforce_eager=False, block_size=4, num_kv_blocks=128, capture_sizes=(4,))
    graph, _ = llm.engine._runner.captured.graphs[4, 1]
    addresses = {i.name: i.buffer.data_ptr() for i in graph.inputs}
    # Four requests decode together; three leave after 2 tokens, so the last steps
    # replay bucket 4 with a single live row.
    lengths = (12, 2, 2, 2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(PROMPTS, params)
    assert {i.name: i.buffer.data_ptr() for i in graph.inputs} == addresses
    buffers = {i.name: i.buffer for i in graph.inputs}
    assert (buffers["slot_mapping"][1:] == -1).all()
    assert (buffers["positions"][1:] == 0).all()
    assert (buffers["input_ids"][1:] == 0).all()
    assert (buffers["seq_lens"][1:] == 0).all()
    assert (buffers["block_table"][1:] == 0).all()
    assert (buffers["query_start_loc"][1:] == 1).all()  # repeats the last real offset
    assert buffers["seq_lens"][0] > 0 and buffers["block_table"][0].any()


def test_graphs_default_to_on_and_compiled(monkeypatch):
    from updraft.config import COMPILE_GRAPHS_ENV, EngineConfig

    monkeypatch.delenv(COMPILE_GRAPHS_ENV)
    assert EngineConfig(model="m").use_graphs and EngineConfig(model="m").compiles_graphs
    assert EngineConfig(model="m", device="cuda").use_graphs
    assert not EngineConfig(model="m", enforce_eager=True).use_graphs
    assert not EngineConfig(model="m", compile_graphs=False).compiles_graphs
    monkeypatch.setenv(COMPILE_GRAPHS_ENV, "0")
    assert not EngineConfig(model="m").compiles_graphs
    assert EngineConfig(model="m", compile_graphs=True).compiles_graphs
    assert EngineConfig(model="m", enforce_eager=False).use_graphs


def test_an_engine_with_captured_steps_is_freed_without_the_cycle_collector(tiny_llama):
    """Graphs hold buffers and KV caches: a reference cycle through them would keep every
    finished engine's memory until Python's cycle collector happens to run."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        llm = LLM(tiny_llama, num_kv_blocks=16, capture_sizes=(1, 2))
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        captured = weakref.ref(llm.engine._runner.captured)
        kv_cache = weakref.ref(llm.engine._runner.kv_caches[0])
        del llm
        assert captured() is None and kv_cache() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek-v3", "deepseek-v3.2"])
def test_full_graphs_hold_attention_and_match_eager_in_decode_and_verify_steps(tmp_path, kind):
    """graph_mode="full": attention shaped by the bucket inside the graph (no task),
    through decode steps and n-gram and draft-model verify steps, with sanitize on."""
    from tests.conftest import DEEPSEEK, make_deepseek_checkpoint, make_tiny_checkpoint

    make = make_deepseek_checkpoint if kind in DEEPSEEK else make_tiny_checkpoint
    model_dir = make(kind, tmp_path / kind)
    prompts = [*PROMPTS, [5, 6, 7] * 8]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 5, 12, 9, 30)
    ]
    args = dict(block_size=4, num_kv_blocks=256, capture_sizes=(1, 2, 4))
    for speculation in ({}, {"speculative_method": "ngram"}, {"speculative_model": str(model_dir)}):
        eager = LLM(model_dir, enforce_eager=True, **args, **speculation)
        full = LLM(model_dir, graph_mode="full", sanitize=True, **args, **speculation)
        eager_probe, full_probe = LogitsProbe(eager), LogitsProbe(full)
        expected, got = eager.generate(prompts, params), full.generate(prompts, params)
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, (kind, speculation)
            torch.testing.assert_close(full_probe.of(g), eager_probe.of(e), atol=1e-4, rtol=0)
        stats = full.engine.stats()
        assert stats.steps["graph"] > 0 and stats.sanitize.healthy, stats.sanitize.mismatches
        runner = full.engine._runner
        assert all(not graph.backend.tasks for graph, _ in runner.captured.graphs.values())
        if speculation:
            assert stats.speculative.rounds > 0
