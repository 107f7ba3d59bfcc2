"""With captured decode steps on, the engine gives eager's logits and greedy tokens, and
reports how each step ran."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import greedy
from tests.probes import logits_of, probed, records
from updraft import LLM
from updraft.runner.captured import CapturedSteps
from updraft.runner.runner import Runner

PROMPTS = [list(range(3, 10)), [200, 17], list(range(40, 77)), [5] * 9]


# Op by op for every layout; compiled (inductor's seconds per model) for GQA with
# untied embeddings and for MHA with q/k norms: Qwen2's biases and tied head add no
# run of ops that inductor would compile differently from these.
@pytest.mark.parametrize(
    "tiny_checkpoint, compile_graphs",
    [("llama", False), ("qwen2", False), ("qwen3", False), ("llama", True), ("qwen3", True)],
    ids=["llama-op by op", "qwen2-op by op", "qwen3-op by op", "llama-compiled", "qwen3-compiled"],
    indirect=["tiny_checkpoint"],
)
def test_graph_replay_matches_eager_through_the_engine(tiny_checkpoint, compile_graphs):
    kind, model_dir = tiny_checkpoint
    params = greedy(20)
    # Prefills stay eager (capture_tokens=()): test_graph_prefill.py replays them.
    args = dict(block_size=4, num_kv_blocks=128, capture_sizes=(1, 2, 4), capture_tokens=())
    eager = probed(model_dir, enforce_eager=True, **args)
    graph = probed(model_dir, enforce_eager=False, compile_graphs=compile_graphs, **args)
    # Requests join and leave: different lengths finish at different steps.
    many = [greedy(n) for n in (20, 5, 12, 1)]
    runs = []
    for prompts, sampling in ((PROMPTS, params), (PROMPTS, many), (PROMPTS[:1], params)):
        runs.append((eager.generate(prompts, sampling), graph.generate(prompts, sampling)))
    modes = graph.engine.stats().steps
    assert modes["graph"] > 0 and modes["eager (prefill)"] > 0
    assert set(eager.engine.stats().steps) == {"eager (graphs off)"}
    eager_seen, graph_seen = records(eager), records(graph)
    for expected, got in runs:
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, kind
            torch.testing.assert_close(
                logits_of(graph_seen, g), logits_of(eager_seen, e), atol=1e-5, rtol=0
            )


def test_buffers_keep_their_address_and_padded_rows_their_pad_values(tiny_llama):
    llm = probed(
        tiny_llama,
        enforce_eager=False,
        block_size=4,
        num_kv_blocks=128,
        capture_sizes=(4,),
    )
    # Four requests decode together; three leave after 2 tokens, so the last steps
    # replay bucket 4 with a single live row.
    lengths = (12, 2, 2, 2)
    llm.generate(PROMPTS, [greedy(n) for n in lengths])
    replays = records(llm).replays()
    assert len({tuple(sorted(r.pointers.items())) for r in replays}) == 1  # never moved
    buffers = replays[-1].buffers
    # query_start_loc repeats the last real offset; the rest hold their pad values.
    pads = dict(slot_mapping=-1, positions=0, input_ids=0, seq_lens=0, block_table=0)
    for name, pad in {**pads, "query_start_loc": 1}.items():
        assert (buffers[name][1:] == pad).all(), name
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

    def alive() -> int:  # runners (which hold the KV caches) and their captured steps
        return sum(type(o) in (Runner, CapturedSteps) for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = alive()
        llm = LLM(tiny_llama, num_kv_blocks=16, capture_sizes=(1, 2))
        llm.generate([[1, 2, 3]], greedy(3))
        assert alive() == before + 2
        del llm
        assert alive() == before
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek-v3", "deepseek-v3.2"])
def test_full_graphs_hold_attention_and_match_eager_in_decode_and_verify_steps(tmp_path, kind):
    """graph_mode="full": attention shaped by the bucket inside the graph (no task),
    through decode steps and n-gram and draft-model verify steps, with sanitize on."""
    from tests.checkpoints import build_checkpoint

    model_dir = build_checkpoint(kind, tmp_path / kind)
    prompts = [*PROMPTS, [5, 6, 7] * 8]
    params = [greedy(n) for n in (24, 5, 12, 9, 30)]
    args = dict(block_size=4, num_kv_blocks=256, capture_sizes=(1, 2, 4))
    for speculation in ({}, {"speculative_method": "ngram"}, {"speculative_model": str(model_dir)}):
        eager = probed(model_dir, enforce_eager=True, **args, **speculation)
        full = probed(model_dir, graph_mode="full", sanitize=True, **args, **speculation)
        expected, got = eager.generate(prompts, params), full.generate(prompts, params)
        stats = full.engine.stats()
        assert stats.steps["graph"] > 0 and stats.sanitize.healthy, stats.sanitize.mismatches
        if speculation:
            assert stats.speculative.rounds > 0
        eager_seen, full_seen = records(eager), records(full)
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, (kind, speculation)
            torch.testing.assert_close(
                logits_of(full_seen, g), logits_of(eager_seen, e), atol=1e-4, rtol=0
            )
        # Every replay was one graph with attention inside: no task ran between segments.
        assert {r.graph_mode for r in full_seen.replays()} == {"FULL"}
