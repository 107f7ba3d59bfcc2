"""UpdatableGraph: replay refreshes every declared input itself, and a bad hook for the
tasks' fresh kwargs makes replay fail before any buffer changes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from updraft.graph.recorded import RecordedGraph
from updraft.graph.static_input import StaticInput
from updraft.graph.tasks import register_task
from updraft.graph.updatable import GraphReplayError, UpdatableGraph


def masked_sum(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.stack(
        [x[i, :n].sum() for i, n in enumerate(lengths)]
        + [x.new_zeros(())] * (x.shape[0] - len(lengths))
    )


def make_graph():
    tokens = StaticInput("tokens", torch.zeros(4, 3), fill=lambda s: s["tokens"], pad=0)
    graph = UpdatableGraph(
        RecordedGraph(constants=[], persistent=[tokens.buffer]),
        inputs=[tokens],
        task_kwargs=lambda s: {"lengths": s["lengths"]},  # the host-side lengths
    )

    def forward():
        doubled = tokens.buffer * 2
        return register_task(masked_sum, {"x": doubled, "lengths": [3, 3, 3, 3]}, "sum")

    return graph, tokens, forward


def step(rows: int, lengths: list[int]) -> dict:
    return {"tokens": torch.arange(rows * 3, dtype=torch.float32).view(rows, 3), "lengths": lengths}


@torch.no_grad()
def test_replay_refreshes_inputs_and_params_from_the_step():
    graph, tokens, forward = make_graph()
    out = graph.capture(forward, step(4, [3, 3, 3, 3]))
    address = tokens.buffer.data_ptr()
    graph.replay(step(2, [1, 2]))
    assert out.tolist() == [0.0, 2 * (3 + 4), 0.0, 0.0]
    assert tokens.buffer[2:].eq(0).all() and tokens.buffer.data_ptr() == address


@dataclass(frozen=True)
class Broken:
    result: object

    def __call__(self, step: dict) -> dict:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize(
    "bad_result",
    [{"lengths": [1], "extra": 1}, {}, ValueError("no lengths today"), [1, 2]],
    ids=["too-many-params", "too-few-params", "raises", "not-a-dict"],
)
@torch.no_grad()
def test_a_bad_task_kwargs_hook_fails_replay_before_any_buffer_changes(bad_result):
    graph, tokens, forward = make_graph()
    out = graph.capture(forward, step(4, [3, 3, 3, 3]))
    graph.replay(step(3, [1, 2, 3]))
    graph.task_kwargs = Broken(bad_result)
    buffers_before, out_before = tokens.buffer.clone(), out.clone()
    with pytest.raises(GraphReplayError):
        graph.replay(step(1, [2]))
    assert torch.equal(tokens.buffer, buffers_before) and torch.equal(out, out_before)


@torch.no_grad()
def test_a_key_owning_two_tasks_is_refused_at_capture():
    graph, _, forward = make_graph()

    def twice():
        forward()
        return forward()

    with pytest.raises(GraphReplayError, match="more than one task"):
        graph.capture(twice, step(4, [3, 3, 3, 3]))


def test_a_task_taking_tensors_inside_an_object_is_refused_at_capture():
    """A tensor a task reads from inside a dataclass is invisible to the graph: a
    compiled run would not write it for the task, which would read the capture's
    values. Capture names it instead."""

    @dataclass
    class Box:
        values: torch.Tensor

    def scaled(box: Box, scale: float) -> torch.Tensor:
        return box.values * scale

    x = torch.ones(4)
    graph = UpdatableGraph(
        RecordedGraph(constants=[], persistent=[x]), [], lambda step: {"scale": 2.0}
    )
    with torch.inference_mode(), pytest.raises(GraphReplayError, match=r"inside Box\.values"):
        graph.capture(lambda: register_task(scaled, {"box": Box(x * 3), "scale": 1.0}, "s"), None)


def test_a_task_not_taking_a_fresh_kwarg_is_refused_at_capture():
    """A task the hook's kwargs do not reach would replay its capture's values."""
    x = torch.ones(4)
    graph = UpdatableGraph(
        RecordedGraph(constants=[], persistent=[x]), [], lambda step: {"lengths": [4]}
    )
    with torch.inference_mode(), pytest.raises(GraphReplayError, match="takes no lengths"):
        graph.capture(lambda: register_task(torch.mul, {"input": x, "other": 2.0}, "mul"), None)


@torch.no_grad()
def test_a_graph_without_tasks_makes_no_fresh_kwargs_at_replay():
    tokens = StaticInput("tokens", torch.zeros(4, 3), fill=lambda s: s["tokens"], pad=0)
    calls = []

    def task_kwargs(step: dict) -> dict:
        calls.append(step)
        return {"lengths": step["lengths"]}

    graph = UpdatableGraph(
        RecordedGraph(constants=[], persistent=[tokens.buffer]), [tokens], task_kwargs
    )
    out = graph.capture(lambda: tokens.buffer.sum(-1) * 2, step(4, [3, 3, 3, 3]))
    # Made once at capture, to fix the names; a replay (a decode step's FULL graph) has
    # no task to give them to.
    assert len(calls) == 1
    graph.replay(step(2, [1, 2]))
    assert len(calls) == 1
    assert out.tolist() == [2 * (0 + 1 + 2), 2 * (3 + 4 + 5), 0.0, 0.0]
