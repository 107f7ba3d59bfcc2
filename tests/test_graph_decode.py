"""A decode step captured with the recorded backend replays exactly like eager, and a
skipped refresh of any declared input shows up in its output: for GQA (Llama), MLA
(DeepSeek-V3) and MLA with sparse attention (DeepSeek-V3.2) alike."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_deepseek_checkpoint
from updraft import LLM, SamplingParams
from updraft.attention import latent
from updraft.attention.metadata import AttentionMetadata
from updraft.runner.captured import CapturedSteps

BUCKET = 4  # decode requests per captured step


def run(
    tiny_llama, skip: str | None = None, compile_runs: bool = False, full: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Decode 3 requests for 8 steps; before the engine runs each decode step, it is run
    both eagerly and by replay of a separately captured graph (its runs of ops compiled
    or not; attention a task between segments, or with ``full`` inside the graph),
    each from the same KV cache. Returns both logits sequences."""
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=4, enforce_eager=True)
    engine = llm.engine
    runner = engine._runner
    captured = CapturedSteps(
        runner.model,
        runner.kv_caches,
        4,
        16,
        [BUCKET],
        runner.device,
        compile_runs=compile_runs,
        full=full,
    )
    graph, (_, graph_logits) = captured.graphs[BUCKET, 1]
    assert (len(graph.backend.tasks) == 0) == full  # FULL: nothing runs between segments
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


@pytest.mark.parametrize("full", [False, True], ids=["piecewise", "full"])
@pytest.mark.parametrize("compile_runs", [False, True], ids=["op by op", "compiled"])
def test_replayed_decode_steps_equal_eager(tiny_llama, compile_runs, full):
    eager, replayed = run(tiny_llama, compile_runs=compile_runs, full=full)
    for e, g in zip(eager, replayed, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "compile_runs, full",
    [(False, False), (True, False), (False, True)],
    ids=["op by op", "compiled", "full"],
)
@pytest.mark.parametrize("skip", ["block_table", "slot_mapping", "seq_lens", "positions"])
def test_skipping_one_refresh_makes_outputs_diverge(tiny_llama, skip, compile_runs, full):
    eager, replayed = run(tiny_llama, skip=skip, compile_runs=compile_runs, full=full)
    worst = max((g - e).abs().max().item() for e, g in zip(eager, replayed, strict=True))
    assert worst > 1e-2, f"skipping the {skip} refresh went unnoticed"


@pytest.fixture(scope="module", params=["deepseek-v3", "deepseek-v3.2"])
def deepseek(request, tmp_path_factory):
    return make_deepseek_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("full", [False, True], ids=["piecewise", "full"])
@pytest.mark.parametrize("compile_runs", [False, True], ids=["op by op", "compiled"])
def test_latent_attention_replays_equal_eager(deepseek, compile_runs, full):
    eager, replayed = run(deepseek, compile_runs=compile_runs, full=full)
    for e, g in zip(eager, replayed, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


@pytest.mark.parametrize("full", [False, True], ids=["piecewise", "full"])
@pytest.mark.parametrize("skip", ["block_table", "slot_mapping", "seq_lens", "positions"])
def test_latent_attention_notices_a_skipped_refresh(deepseek, skip, full):
    eager, replayed = run(deepseek, skip=skip, full=full)
    worst = max((g - e).abs().max().item() for e, g in zip(eager, replayed, strict=True))
    assert worst > 1e-2, f"skipping the {skip} refresh went unnoticed"


def test_a_stale_seq_lens_changes_the_sparse_attention_selection(tmp_path, monkeypatch):
    """DSA's top-k tokens are chosen inside the step from seq_lens: a replay that kept
    the captured lengths would choose other tokens, and the output shows it. (Piecewise
    graphs run the selection as Python a spy can see; in FULL graphs it is recorded ops,
    and the stale-input tests above cover it through the output.)"""
    model_dir = make_deepseek_checkpoint("deepseek-v3.2", tmp_path)
    chosen = []
    choose = latent.IndexerScores.choose

    def spy(self, group):
        selected = choose(self, group)
        chosen.append(selected.columns(64)[:, 0])  # each decode's row; contexts < 64
        return selected

    monkeypatch.setattr(latent.IndexerScores, "choose", spy)
    for skip in (None, "seq_lens"):
        chosen.clear()
        eager, _ = run(model_dir, skip=skip)
        # One prefill step (3 layers), then per decode step 3 layers each of: the eager
        # run, the replay, and the engine's own (eager) step.
        steps = [chosen[i : i + 9] for i in range(3, len(chosen), 9)]
        assert len(steps) == len(eager)
        same = all(
            torch.equal(a, b) for step in steps for a, b in zip(step[:3], step[3:6], strict=True)
        )
        assert same == (skip is None), skip
