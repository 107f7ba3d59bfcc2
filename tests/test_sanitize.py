"""Sanitize mode checks every replay against eager on a copy of the KV cache: a healthy
engine passes, and a forgotten refresh of any declared input is reported."""

from __future__ import annotations

import pytest

from updraft import LLM, SamplingParams

PROMPTS = [list(range(3, 10)), [200, 17], list(range(40, 77))]
ARGS = dict(block_size=4, num_kv_blocks=64, capture_sizes=(1, 2, 4), enforce_eager=False)


def generate(llm: LLM) -> None:
    lengths = (12, 4, 9)  # requests leave at different steps, so buckets shrink
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(PROMPTS, params)


def test_sanitize_finds_replay_equal_to_eager(tiny_checkpoint):
    kind, model_dir = tiny_checkpoint
    llm = LLM(model_dir, sanitize=True, **ARGS)
    generate(llm)
    stats = llm.engine.stats()
    report = stats.sanitize
    assert report.steps == stats.steps["graph"] > 0
    assert report.healthy, (kind, report.mismatches)
    assert report.max_output_diff < 1e-4 and report.max_state_diff < 1e-4


@pytest.mark.parametrize("skip", ["block_table", "slot_mapping", "seq_lens", "positions"])
def test_sanitize_reports_a_skipped_refresh(tiny_llama, skip):
    llm = LLM(tiny_llama, sanitize=True, **ARGS)
    for graph, _ in llm.engine._runner.captured.graphs.values():
        (forgotten,) = [i for i in graph.inputs if i.name == skip]
        # A code path that forgets one refresh (StaticInput is frozen).
        object.__setattr__(forgotten, "refresh", lambda values: None)
    generate(llm)
    report = llm.engine.stats().sanitize
    assert not report.healthy, f"skipping the {skip} refresh went unreported"
    assert "differs" in report.mismatches[0]


def test_sanitize_is_off_by_default(tiny_llama):
    assert LLM(tiny_llama, **ARGS).engine.stats().sanitize is None
