"""A decode step captured with the recorded backend replays exactly like eager, and a
skipped refresh of any declared input shows up in its output: for GQA (Llama), MLA
(DeepSeek-V3) and MLA with sparse attention (DeepSeek-V3.2) alike. Every replay is
checked against an eager run of the same step from the same KV cache (sanitize)."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.helpers import greedy
from tests.mutations import forget_refresh
from tests.probes import probed, records
from updraft.attention import latent
from updraft.graph.sanitize import SanitizeReport

BUCKET = 4  # decode requests per captured step


def run(model_dir, compile_runs: bool = False, full: bool = False) -> SanitizeReport:
    """Decode 3 requests for 8 steps, each step a replay of bucket 4 (its runs of ops
    compiled or not; attention a task between segments, or with ``full`` inside the
    graph) checked against eager from the same KV cache. -> the replays' sanitize
    report."""
    llm = probed(
        model_dir,
        num_kv_blocks=64,
        block_size=4,
        capture_sizes=(BUCKET,),
        capture_tokens=(),  # prefills eager: test_graph_prefill.py replays them
        compile_graphs=compile_runs,
        graph_mode="full" if full else "piecewise",
        sanitize=True,
    )
    prompts = ([1, 2, 3, 4, 5], [6, 7], list(range(20, 31)))
    llm.generate(prompts, greedy(9))
    report = llm.engine.stats().sanitize
    replays = records(llm).replays()
    assert report.steps == len(replays) == 8
    # FULL: nothing runs between segments.
    assert {r.graph_mode for r in replays} == {"FULL" if full else "PIECEWISE"}
    return report


@pytest.mark.parametrize("full", [False, True], ids=["piecewise", "full"])
@pytest.mark.parametrize("compile_runs", [False, True], ids=["op by op", "compiled"])
def test_replayed_decode_steps_equal_eager(tiny_llama, compile_runs, full):
    report = run(tiny_llama, compile_runs=compile_runs, full=full)
    assert report.healthy and report.max_output_diff < 1e-5, report.summary()


@pytest.mark.parametrize(
    "compile_runs, full",
    [(False, False), (True, False), (False, True)],
    ids=["op by op", "compiled", "full"],
)
@pytest.mark.parametrize("skip", ["block_table", "slot_mapping", "seq_lens", "positions"])
def test_skipping_one_refresh_makes_outputs_diverge(
    tiny_llama, skip, compile_runs, full, monkeypatch
):
    forget_refresh(monkeypatch, skip)
    report = run(tiny_llama, compile_runs=compile_runs, full=full)
    assert report.max_output_diff > 1e-2, f"skipping the {skip} refresh went unnoticed"
    assert not report.healthy and "differs" in report.mismatches[0]


@pytest.fixture(scope="module", params=["deepseek-v3", "deepseek-v3.2"])
def deepseek(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


# Op by op in both graph modes for both; compiled once each (inductor's seconds per
# model): V3 piecewise, V3.2 (whose indexer is inside the graph) full.
@pytest.mark.parametrize(
    "deepseek, compile_runs, full",
    [
        ("deepseek-v3", False, False),
        ("deepseek-v3", False, True),
        ("deepseek-v3.2", False, False),
        ("deepseek-v3.2", False, True),
        ("deepseek-v3", True, False),
        ("deepseek-v3.2", True, True),
    ],
    ids=[
        "v3-op by op-piecewise",
        "v3-op by op-full",
        "v3.2-op by op-piecewise",
        "v3.2-op by op-full",
        "v3-compiled-piecewise",
        "v3.2-compiled-full",
    ],
    indirect=["deepseek"],
)
def test_latent_attention_replays_equal_eager(deepseek, compile_runs, full):
    report = run(deepseek, compile_runs=compile_runs, full=full)
    assert report.healthy and report.max_output_diff < 1e-5, report.summary()


@pytest.mark.parametrize("full", [False, True], ids=["piecewise", "full"])
@pytest.mark.parametrize("skip", ["block_table", "slot_mapping", "seq_lens", "positions"])
def test_latent_attention_notices_a_skipped_refresh(deepseek, skip, full, monkeypatch):
    forget_refresh(monkeypatch, skip)
    report = run(deepseek, full=full)
    assert report.max_output_diff > 1e-2, f"skipping the {skip} refresh went unnoticed"


def test_a_stale_seq_lens_changes_the_sparse_attention_selection(tmp_path, monkeypatch):
    """DSA's top-k tokens are chosen inside the step from seq_lens: a replay that kept
    the captured lengths would choose other tokens, and the output shows it. (Piecewise
    graphs run the selection as Python a spy can see; in FULL graphs it is recorded ops,
    and the stale-input tests above cover it through the output.)"""
    model_dir = build_checkpoint("deepseek-v3.2", tmp_path / "model")
    chosen = []
    choose = latent.IndexerScores.choose

    def spy(self, group):
        selected = choose(self, group)
        if group.query_index.shape[1] == 1:  # a decode group (prefills may be several)
            chosen.append(selected.columns(64)[:, 0])  # each decode's row; contexts < 64
        return selected

    monkeypatch.setattr(latent.IndexerScores, "choose", spy)
    for skip in (None, "seq_lens"):
        with monkeypatch.context() as patch:
            if skip is not None:
                forget_refresh(patch, skip)
            chosen.clear()
            run(model_dir)
        # Per decode step, 3 layers each of: the replay, and the eager run it is
        # checked against.
        steps = [chosen[i : i + 6] for i in range(0, len(chosen), 6)]
        assert len(steps) == 8
        same = all(
            torch.equal(a, b) for step in steps for a, b in zip(step[:3], step[3:6], strict=True)
        )
        assert same == (skip is None), skip
