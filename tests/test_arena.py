"""A recorded graph's intermediates share one arena by lifetime: storages whose replay
calls meet never share a byte, reuse happens, and a replay from the arena equals the
function run again, op by op and compiled alike."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_recorded_graph import scaled
from updraft.graph.arena import ALIGNMENT, arena_offsets
from updraft.graph.recorded import RecordedGraph
from updraft.graph.recorded_nodes import storage_of
from updraft.graph.tasks import register_task

lives_and_sizes = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 8), st.integers(1, 500)), min_size=1, max_size=40
)


@settings(max_examples=300, deadline=None)
@given(lives_and_sizes)
def test_storages_alive_at_the_same_call_never_overlap(items):
    lives = {i: (born, born + length) for i, (born, length, _) in enumerate(items)}
    sizes = {i: size for i, (_, _, size) in enumerate(items)}
    offsets, total = arena_offsets(lives, sizes)
    assert all(offset % ALIGNMENT == 0 for offset in offsets.values())
    assert all(offsets[i] + sizes[i] <= total for i in lives)
    for a in lives:
        for b in lives:
            if a < b and lives[a][0] <= lives[b][1] and lives[b][0] <= lives[a][1]:
                disjoint = (
                    offsets[a] + sizes[a] <= offsets[b] or offsets[b] + sizes[b] <= offsets[a]
                )
                assert disjoint, (lives[a], lives[b], offsets[a], offsets[b])


def test_a_storage_born_after_another_dies_takes_its_place():
    offsets, total = arena_offsets({0: (0, 1), 1: (1, 2), 2: (2, 3)}, {0: 100, 1: 100, 2: 100})
    # 0 and 1 meet at call 1, 1 and 2 at call 2; 2 is born after 0's last call.
    assert offsets[0] == offsets[2] != offsets[1]
    assert total == 2 * 128


class Chain(torch.nn.Module):
    """A dozen layers in a row, each a run of ops and then a task, whose results only
    the next layer reads: a graph that keeps them all holds a few dozen [64, 256]
    tensors, an arena a few."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(256, 256) / 16)
        self.inputs = torch.zeros(64, 256)

    def forward(self, factor: float = 1.0) -> torch.Tensor:
        hidden = self.inputs
        for layer in range(12):
            hidden = torch.tanh(hidden @ self.weight) * 1.5 + hidden.sin()
            hidden = register_task(scaled, {"x": hidden, "factor": factor}, layer)
        return hidden.sum(-1)


@pytest.mark.parametrize("compile_runs", [False, True], ids=["op by op", "compiled"])
@torch.no_grad()
def test_a_replay_from_the_arena_equals_running_again(compile_runs):
    torch.manual_seed(0)
    model = Chain()
    graph = RecordedGraph(
        constants=model.parameters(), persistent=[model.inputs], compile_runs=compile_runs
    )
    out = graph.capture(model)
    assert graph.arena is not None
    layer_bytes = 64 * 256 * 4
    assert graph.arena.numel() <= 6 * layer_bytes  # not twelve layers' worth, nor more
    for factor in (0.5, -0.5, 0.75):  # factors below 1: rounding is not amplified
        model.inputs.copy_(torch.randn(64, 256))
        graph.replay({"factor": factor})
        # Inductor rounds tanh and sin its own way; memory shared wrongly is far off.
        torch.testing.assert_close(out, model(factor), rtol=1e-4, atol=1e-4)
    # What the graph returns stays out of the arena: a replay writes it, nothing else.
    arena = graph.arena.untyped_storage()
    start, end = arena.data_ptr(), arena.data_ptr() + arena.nbytes()
    assert not start <= storage_of(out) < end
