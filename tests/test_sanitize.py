"""Sanitize mode checks every replay against eager on a copy of the KV cache: a healthy
engine passes (and ``test_graph_decode.py`` shows a forgotten refresh of any declared
input reported, for every attention kind and graph mode)."""

from __future__ import annotations

from tests.helpers import greedy
from updraft import LLM

PROMPTS = [list(range(3, 10)), [200, 17], list(range(40, 77))]
ARGS = dict(block_size=4, num_kv_blocks=64, capture_sizes=(1, 2, 4), enforce_eager=False)


def generate(llm: LLM) -> None:
    lengths = (12, 4, 9)  # requests leave at different steps, so buckets shrink
    params = [greedy(n) for n in lengths]
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


def test_sanitize_is_off_by_default(tiny_llama):
    assert LLM(tiny_llama, **ARGS).engine.stats().sanitize is None
