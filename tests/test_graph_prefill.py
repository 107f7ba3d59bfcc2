"""Mixed steps (prefill chunks, alone or beside decodes) replay captured graphs padded to
a token bucket, with attention a task resolved from each step and the matrix products
over the step's own tokens only. Each replay is checked against eager from the same KV
cache (sanitize) on every model family, a skipped refresh of any declared input shows
in the output, and a step that fits no bucket runs eagerly."""

from __future__ import annotations

import pytest

from tests.checkpoints import build_checkpoint
from tests.helpers import greedy
from tests.mutations import forget_refresh
from tests.probes import probed, records
from updraft.config import CAPTURE_TOKENS, CAPTURE_TOKENS_ENV, EngineConfig
from updraft.graph.sanitize import SanitizeReport

TOKENS = (8, 16, 32)  # mixed buckets; the prompts' chunks below fill each partly
# Prompts of 5-30 tokens, chunked at 32 tokens a step: steps of one prompt's chunk, of
# several prompts, of chunks beside decodes, and a step above no bucket (eager).
PROMPTS = (list(range(1, 6)), list(range(40, 70)), list(range(100, 113)), [7, 8])

# Each test id's checkpoint family (tests/checkpoints.py).
FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "deepseek-v2": "deepseek-v2",
    "deepseek-v3": "deepseek-v3",
    "deepseek-v3.2": "deepseek-v3.2",
    "qwen3-moe": "qwen3-moe",
    "mixtral": "mixtral",
    "phi3-longrope": "phi3",
    "mistral-window": "mistral-window",
    "gemma3": "gemma3",
}


def run(model_dir, compile_runs: bool = False, **engine_args) -> SanitizeReport:
    """The prompts, 6 greedy tokens each, two requests at a time so that later prompts
    prefill beside decodes; every replay checked against eager. -> the sanitize report,
    after asserting that mixed buckets (their query length 0) replayed steps of fewer
    tokens than their own."""
    llm = probed(
        model_dir,
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        capture_sizes=(2,),
        capture_tokens=TOKENS,
        compile_graphs=compile_runs,
        sanitize=True,
        **engine_args,
    )
    llm.generate([list(p) for p in PROMPTS], greedy(6))
    report = llm.engine.stats().sanitize
    mixed = [r for r in records(llm).replays() if r.bucket[1] == 0]
    assert mixed, "no step replayed a mixed bucket"
    assert any(r.num_tokens < r.bucket[3] for r in mixed), "no mixed step was padded"
    assert {r.graph_mode for r in mixed} == {"PIECEWISE"}
    return report


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mixed_steps_replay_like_eager_on_every_family(family, tmp_path):
    report = run(build_checkpoint(FAMILIES[family], tmp_path / family))
    assert report.healthy and report.max_output_diff < 1e-5, report.summary()


def test_compiled_mixed_steps_replay_like_eager(tmp_path):
    """Compiled once, for Qwen3 (inductor's seconds per bucket); the runs are the same
    code paths as decode steps' compiled runs, which test_graph_decode.py checks."""
    report = run(build_checkpoint("qwen3", tmp_path / "qwen3"), compile_runs=True)
    assert report.healthy and report.max_output_diff < 1e-5, report.summary()


@pytest.mark.parametrize(
    "skip", ["input_ids", "positions", "slot_mapping", "block_table", "seq_lens"]
)
def test_skipping_one_refresh_of_a_mixed_step_makes_outputs_diverge(skip, tmp_path, monkeypatch):
    forget_refresh(monkeypatch, skip)
    report = run(build_checkpoint("qwen3", tmp_path / "qwen3"))
    assert report.max_output_diff > 1e-2, f"skipping the {skip} refresh went unnoticed"
    assert not report.healthy


def test_a_stale_query_start_loc_fails_the_step(tmp_path, monkeypatch):
    """Each request's token range comes from query_start_loc: replayed stale, the
    attention task reads token rows outside the step's and fails."""
    forget_refresh(monkeypatch, "query_start_loc")
    with pytest.raises(IndexError):
        run(build_checkpoint("qwen3", tmp_path / "qwen3"))


def test_capture_tokens_come_from_the_setting_else_the_environment_else_the_default(
    monkeypatch,
):
    monkeypatch.delenv(CAPTURE_TOKENS_ENV, raising=False)
    assert EngineConfig(model="m").mixed_capture_tokens == CAPTURE_TOKENS
    monkeypatch.setenv(CAPTURE_TOKENS_ENV, "24,48")
    assert EngineConfig(model="m").mixed_capture_tokens == (24, 48)
    assert EngineConfig(model="m", capture_tokens=()).mixed_capture_tokens == ()
    monkeypatch.setenv(CAPTURE_TOKENS_ENV, "24,x")
    with pytest.raises(ValueError, match="UPDRAFT_CAPTURE_TOKENS must be comma-separated"):
        EngineConfig(model="m")
