"""What users run, under speculation: captured steps whose runs of ops inductor
compiled (the default outside this suite), through the engine, for every proposer the
other replay tests run op by op. Every replay, the target's and the proposer's model's
alike, is checked against eager from the same KV cache (sanitize: its output and every
KV write, so a compiled run that dropped a result only a cache write reads is caught),
and greedy output equals an eager engine's. The compiled replays of plain decoding are
in ``test_graph_engine.py`` (the Llama family) and ``test_graph_decode.py`` (DeepSeek
V3 and V3.2)."""

from __future__ import annotations

import pytest

from tests.checkpoints import build_checkpoint, eagle_head_checkpoint, mtp_checkpoint
from tests.helpers import greedy, token_ids
from updraft import LLM

# Requests decoding together through one bucket, and drafts of k = 2: each model
# compiles few distinct runs. The plain replay tests' bucket and cache sizes
# (test_graph_engine.py's for Llama, test_graph_decode.py's for DeepSeek), so that the
# runs of their decode steps, which inductor has compiled by then, come from its cache.
PROMPTS = [list(range(10, 31)), [5, 6, 7] * 5, list(range(40, 50))]
PARAMS = [greedy(12), greedy(9), greedy(10)]
# Prefills eager: compiling mixed buckets too would double inductor's time here, and
# test_graph_prefill.py compiles them.
ARGS = dict(block_size=4, capture_sizes=(4,), capture_tokens=(), num_speculative_tokens=2)


def assert_compiled_replays_like_eager(model_dir, num_kv_blocks: int, **speculation) -> None:
    args = {**ARGS, "num_kv_blocks": num_kv_blocks, **speculation}
    expected = LLM(model_dir, enforce_eager=True, **args).generate(PROMPTS, PARAMS)
    llm = LLM(model_dir, compile_graphs=True, sanitize=True, **args)
    assert token_ids(llm.generate(PROMPTS, PARAMS)) == token_ids(expected)
    stats = llm.engine.stats()
    assert stats.steps["graph"] > 0 and stats.sanitize.healthy, stats.sanitize.mismatches
    if speculation:
        assert stats.speculative.rounds > 0
    if stats.draft_steps is not None:
        assert stats.draft_steps["graph"] > 0, stats.draft_steps
        assert stats.draft_sanitize.healthy, stats.draft_sanitize.mismatches


@pytest.mark.parametrize("method", ["draft", "ngram", "eagle", "mtp"])
def test_compiled_steps_of_every_proposer_replay_like_eager(method, tmp_path):
    """Verify steps of every proposer, and the draft model's and heads' own steps (the
    heads' greedy draft loop included, which sanitize does not check: greedy output
    does)."""
    if method == "mtp":
        target, head, blocks = mtp_checkpoint(tmp_path / "mtp"), {}, 64
    else:
        target, blocks = build_checkpoint("llama", tmp_path / "llama"), 128
        head_dir = {
            "draft": lambda: build_checkpoint("llama", tmp_path / "draft", seed=1),
            "eagle": lambda: eagle_head_checkpoint(tmp_path / "head", target),
        }.get(method, lambda: None)()
        head = {"speculative_model": str(head_dir)} if head_dir else {}
    assert_compiled_replays_like_eager(target, blocks, speculative_method=method, **head)
