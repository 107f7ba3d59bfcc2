"""The CUDA backend: FULL graphs reading device tensors refreshed in place, PIECEWISE
graphs around host-parameter tasks, and an engine whose CUDA replays equal eager. Needs
a GPU; on a machine without one only the refusal test runs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import greedy, token_ids
from tests.probes import logits_of, probed, records
from updraft import LLM
from updraft.demo import DEMO_MODEL_DIR
from updraft.graph.cuda import CudaGraph
from updraft.graph.recorded import CaptureError
from updraft.graph.tasks import register_task

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


class Toy(torch.nn.Module):
    """Scales its projection by a factor: a task's host-side ``factor``, made fresh at
    each replay (PIECEWISE), or with ``full`` the device tensor ``factor``, refreshed in
    place before each replay as a static input is (FULL)."""

    def __init__(self, full: bool = False) -> None:
        super().__init__()
        self.full = full
        self.proj = torch.nn.Linear(8, 8)
        self.inputs = torch.zeros(4, 8)
        self.factor = torch.ones(())

    def forward(self) -> torch.Tensor:
        hidden = self.proj(self.inputs)
        if self.full:
            hidden = scaled(hidden, self.factor)
        else:
            hidden = register_task(scaled, {"x": hidden, "factor": 1.0}, "scale")
        return torch.relu(hidden).sum(-1)


def capture(model: Toy) -> tuple[CudaGraph, torch.Tensor]:
    graph = CudaGraph(constants=model.parameters(), persistent=[model.inputs, model.factor])
    return graph, graph.capture(model)


def test_cuda_backend_refuses_to_start_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaGraph(constants=[], persistent=[])


@needs_cuda
@pytest.mark.parametrize("full", [False, True], ids=["host-task", "device-tensor"])
@torch.no_grad()
def test_replay_equals_eager_in_both_modes(full):
    torch.manual_seed(0)
    model = Toy(full).cuda()
    model.inputs, model.factor = model.inputs.cuda(), model.factor.cuda()
    graph, out = capture(model)
    assert graph.mode == ("FULL" if full else "PIECEWISE")
    assert len(graph.segments) == (1 if full else 2)
    for value in (3.0, -0.5):
        model.inputs.copy_(torch.randn(4, 8))
        model.factor.copy_(torch.tensor(value, device="cuda"), non_blocking=True)
        graph.replay({"factor": value})
        expected = torch.relu(model.proj(model.inputs) * value).sum(-1)
        torch.testing.assert_close(out, expected)


@needs_cuda
def test_capture_lints_on_cuda_as_on_the_cpu():
    model = Toy().cuda()
    model.inputs = model.inputs.cuda()
    graph = CudaGraph(constants=model.parameters(), persistent=[model.inputs])
    with pytest.raises(CaptureError, match="item"):
        graph.capture(lambda: model.inputs.sum().item())


PROMPTS = [list(range(3, 10)), [200, 17], list(range(40, 77)), [5, 6, 7] * 8]
PARAMS = [greedy(n) for n in (16, 5, 9, 24)]


def engine_on_cuda_replays_like_eager(model_dir, graph_mode: str, **speculation) -> None:
    """Greedy tokens and logits of CUDA replays equal eager's (with sanitize on), so
    does the acceptance per draft position with speculation, and the graphs are FULL or
    PIECEWISE as asked."""
    args = dict(device="cuda", dtype="float32", block_size=4, num_kv_blocks=128, **speculation)
    eager_llm = probed(model_dir, enforce_eager=True, **args)
    eager = eager_llm.generate(PROMPTS, PARAMS)
    llm = probed(model_dir, graph_mode=graph_mode, capture_sizes=(1, 2, 4), sanitize=True, **args)
    graph = llm.generate(PROMPTS, PARAMS)
    stats = llm.engine.stats()
    assert stats.steps["graph"] > 0
    assert stats.sanitize.healthy, stats.sanitize.mismatches
    if speculation:
        assert stats.speculative.rounds > 0
        eager_spec = eager_llm.engine.stats().speculative
        assert stats.speculative.accepted == eager_spec.accepted
        assert stats.speculative.proposed == eager_spec.proposed
    eager_seen, seen = records(eager_llm), records(llm)
    for e, g in zip(eager, graph, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, model_dir
        torch.testing.assert_close(logits_of(seen, g), logits_of(eager_seen, e), atol=1e-4, rtol=0)
    assert {r.graph_mode for r in seen.replays()} == {graph_mode.upper()}


@needs_cuda
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_engine_on_cuda_replays_like_eager(tiny_checkpoint, graph_mode):
    engine_on_cuda_replays_like_eager(tiny_checkpoint[1], graph_mode)


@needs_cuda
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_latent_and_sparse_attention_on_cuda_replay_like_eager(tiny_deepseek, graph_mode):
    """MLA (DeepSeek-V3, with and without q_lora) and DSA (V3.2): decode steps, and
    verify steps of n-gram speculation."""
    engine_on_cuda_replays_like_eager(tiny_deepseek[1], graph_mode)
    engine_on_cuda_replays_like_eager(tiny_deepseek[1], graph_mode, speculative_method="ngram")


@needs_cuda
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_mtp_speculation_on_cuda_replays_like_eager(tmp_path, graph_mode):
    """DeepSeek MTP drafts on CUDA: the target's graphs as above, the MTP layer's own
    graphs reading the target's hidden states."""
    from tests.checkpoints import mtp_checkpoint

    model_dir = mtp_checkpoint(tmp_path)
    engine_on_cuda_replays_like_eager(model_dir, graph_mode, speculative_method="mtp")


@needs_cuda
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_eagle_speculation_on_cuda_replays_like_eager(tmp_path, graph_mode):
    """An EAGLE head's graphs on CUDA, reading the target's hidden states: a tiny Llama
    target with a random head, and the demo target with its trained head."""
    from tests.heads import make_pair

    target, head = make_pair("llama", tmp_path)
    engine_on_cuda_replays_like_eager(
        target, graph_mode, speculative_method="eagle", speculative_model=str(head)
    )
    engine_on_cuda_replays_like_eager(DEMO_MODEL_DIR, graph_mode, speculative_method="eagle")


def self_drafting_on_cuda(model_dir) -> dict:
    """Engine arguments: float32 on CUDA, the model drafting for itself, a small
    chunked-prefill budget (so prompts split under PCP)."""
    return dict(
        device="cuda",
        dtype="float32",
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=32,
        speculative_model=str(model_dir),
        num_speculative_tokens=3,
    )


@needs_cuda
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_a_draft_model_under_pcp_on_cuda_replays_like_eager(tiny_llama, graph_mode):
    """PCP=2 with both ranks on one GPU (their exchanges go through host shared memory:
    NCCL wants a GPU per rank) and the target drafting for itself: the draft's FULL and
    PIECEWISE graphs, refreshed from the global step, keep eager's tokens and its
    acceptance per draft position."""
    args = dict(**self_drafting_on_cuda(tiny_llama), prefill_context_parallel_size=2)
    runs = []
    for eager in (True, False):
        llm = probed(str(tiny_llama), enforce_eager=eager, graph_mode=graph_mode, **args)
        tokens = token_ids(llm.generate(PROMPTS, PARAMS))
        stats = llm.engine.stats()
        runs.append((tokens, stats.speculative.accepted, stats.speculative.proposed))
        assert any("split over 2 ranks" in mode for mode in stats.steps)
        seen = records(llm)
        if not eager:
            assert stats.draft_steps.get("graph", 0) > 0, stats.draft_steps
            assert {r.graph_mode for r in seen.replays("draft")} == {graph_mode.upper()}
    assert runs[0] == runs[1]
    assert runs[1][1][0] > 0


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one GPU per rank)"
)
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
@pytest.mark.parametrize(
    "layout",
    [{"tensor_parallel_size": 2}, {"prefill_context_parallel_size": 2}],
    ids=["tp2", "pcp2"],
)
def test_ranks_over_nccl_replay_like_one_process(tiny_llama, graph_mode, layout):
    """Two ranks on two GPUs, the in-step collectives over NCCL inside the captured
    steps, with the draft model on rank 0: one process's tokens and acceptance."""
    args = dict(**self_drafting_on_cuda(tiny_llama), graph_mode=graph_mode, capture_sizes=(1, 2, 4))
    runs = []
    for split in ({}, layout):
        llm = LLM(str(tiny_llama), **args, **split)
        tokens = token_ids(llm.generate(PROMPTS, PARAMS))
        stats = llm.engine.stats()
        assert stats.steps.get("graph", 0) > 0, stats.steps
        runs.append((tokens, stats.speculative.accepted, stats.speculative.proposed))
        llm.engine.close()
    assert runs[0] == runs[1]


def heads_on_cuda_like_one_process(kind: str, root, graph_mode: str, layout: dict) -> None:
    """A draft head (``tests/heads.py``'s ``kind``) on every rank of ``layout``, its
    graphs FULL or PIECEWISE as asked and refreshed from the global step on every rank:
    one process's tokens and acceptance per draft position."""
    from tests.heads import make_head

    head = make_head(kind, root)
    args = dict(device="cuda", dtype="float32", block_size=4, num_kv_blocks=128)
    args |= dict(max_num_batched_tokens=32, num_speculative_tokens=2, capture_sizes=(1, 2, 4))
    runs = []
    for split in ({}, layout):
        llm = probed(head.target, **args, **head.args, **split, graph_mode=graph_mode)
        tokens = token_ids(llm.generate(PROMPTS, PARAMS))
        stats = llm.engine.stats()
        runs.append((tokens, stats.speculative.accepted, stats.speculative.proposed))
        steps = {r.graph_mode for r in records(llm).replays("head") if not r.bucket[2]}
        assert steps == {graph_mode.upper()}
        llm.engine.close()
    assert runs[0] == runs[1]
    assert runs[1][1][0] > 0 or kind.startswith("mtp")  # random MTP layers rarely agree


@needs_cuda
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
@pytest.mark.parametrize("kind", ["eagle-llama", "mtp", "mtp-dsa"])
def test_heads_under_pcp_on_one_device_replay_like_one_process(tmp_path, kind, graph_mode):
    """PCP=2 with both ranks on one GPU (exchanging through host shared memory), each
    running the head over the global step."""
    heads_on_cuda_like_one_process(kind, tmp_path, graph_mode, {"prefill_context_parallel_size": 2})


@pytest.mark.skipif(
    torch.cuda.device_count() < 4, reason="needs four CUDA devices (NCCL: one GPU per rank)"
)
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
@pytest.mark.parametrize("kind", ["eagle-llama", "mtp", "mtp-dsa"])
def test_heads_over_nccl_replay_like_one_process(tmp_path, kind, graph_mode):
    """PCP=2 x TP=2 on four GPUs, the head split over each tensor pair and its
    collectives over NCCL inside the captured steps."""
    layout = {"prefill_context_parallel_size": 2, "tensor_parallel_size": 2}
    heads_on_cuda_like_one_process(kind, tmp_path, graph_mode, layout)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one GPU per rank)"
)
@pytest.mark.parametrize("kind", ["eagle-llama", "mtp"])
def test_heads_over_nccl_on_two_tensor_ranks_replay_like_one_process(tmp_path, kind):
    heads_on_cuda_like_one_process(kind, tmp_path, "full", {"tensor_parallel_size": 2})
