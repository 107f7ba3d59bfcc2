"""The recorded backend: replay equals re-running the function; what a device graph
cannot hold is refused at capture, naming the op and where it ran."""

from __future__ import annotations

import pytest
import torch

from updraft.graph.recorded import CaptureError, RecordedGraph
from updraft.graph.tasks import register_task


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """A task: its host-side ``factor`` is made fresh at each replay."""
    return x * factor


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.inputs = torch.zeros(3, 4)
        self.slots = torch.zeros(3, dtype=torch.long)
        self.cache = torch.zeros(10, 4)

    def forward(self) -> torch.Tensor:
        hidden = self.proj(self.inputs)
        self.cache.index_copy_(0, self.slots, hidden)
        hidden = register_task(scaled, {"x": hidden, "factor": 2.0}, "scale")
        return torch.relu(hidden).sum(-1)


def capture(model: Toy, fn=None) -> tuple[RecordedGraph, torch.Tensor]:
    graph = RecordedGraph(
        constants=model.parameters(),
        persistent=[model.inputs, model.slots, model.cache],
        module_names={id(m): name or "model" for name, m in model.named_modules()},
    )
    return graph, graph.capture(fn or model)


@torch.no_grad()
def test_replay_recomputes_from_refreshed_inputs_and_task_params():
    torch.manual_seed(0)
    model = Toy()
    graph, out = capture(model)
    assert sum(1 for _ in graph.tasks) == 1
    for factor in (3.0, -1.5):
        model.inputs.copy_(torch.randn(3, 4))
        model.slots.copy_(torch.randperm(10)[:3])
        graph.replay({"factor": factor})
        hidden = model.proj(model.inputs)
        torch.testing.assert_close(out, torch.relu(hidden * factor).sum(-1))
        torch.testing.assert_close(model.cache[model.slots], hidden)


@torch.no_grad()
def test_host_sync_is_refused_naming_op_and_module():
    class SyncingLinear(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if out.sum().item() > 1e9:  # a host-side decision on device data
                out = out * 0
            return out

    model = Toy()
    model.proj = SyncingLinear(4, 4)
    with pytest.raises(CaptureError, match=r"_local_scalar_dense.* at proj syncs with the host"):
        capture(model)


@torch.no_grad()
def test_undeclared_input_is_refused_naming_op_and_shape():
    model = Toy()
    stray = torch.ones(3, 4)
    with pytest.raises(CaptureError, match=r"aten.add.Tensor at \(top level\) reads a \(3, 4\)"):
        capture(model, lambda: model.inputs + stray)


@torch.no_grad()
def test_data_dependent_shape_is_refused():
    model = Toy()
    with pytest.raises(CaptureError, match="output shape that depends on tensor data"):
        capture(model, lambda: model.inputs[model.inputs > 0])


@torch.inference_mode()
def test_a_write_into_a_tensor_made_from_constants_is_refused():
    """``torch.zeros`` reads nothing, so the graph folds it as a constant, and a view of
    it too: a replay would read the capture's values where the step wrote new ones."""
    model = Toy()

    def accumulate() -> torch.Tensor:
        out = torch.zeros(3, 4)
        out[:2] = model.proj(model.inputs)[:2]
        return out.view(12) + 1

    with pytest.raises(CaptureError, match=r"aten.copy_.default at \(top level\) writes into a"):
        capture(model, accumulate)


@torch.inference_mode()  # as the engine captures: these ops then reach the recorder whole
def test_an_op_that_may_alias_but_copied_is_rerun():
    """``to``, ``reshape`` and ``contiguous`` return a view only when they can; when they
    copied, replay must compute the copy again."""
    model = Toy()
    graph, out = capture(
        model,
        lambda: (
            model.inputs.to(torch.float64).sum()
            + model.inputs.t().reshape(-1).cumsum(0).sum()
            + (model.inputs > 0).to(torch.float32).sum()
        ),
    )
    for seed in (1, 2):
        torch.manual_seed(seed)
        model.inputs.copy_(torch.randn(3, 4))
        graph.replay({})
        expected = (
            model.inputs.double().sum()
            + model.inputs.t().reshape(-1).cumsum(0).sum()
            + (model.inputs > 0).float().sum()
        )
        torch.testing.assert_close(out, expected)


@torch.inference_mode()
def test_a_tensor_at_a_freed_constants_address_is_not_taken_for_a_constant():
    """Storages are told apart by address. A constant the graph folded (an arange) and
    then freed would leave its address to a tensor produced later, which would pass for
    a constant: the op reading it would be baked in with the capture's values. The
    recorder keeps folded constants alive, so no address is reused during a capture.
    (Found on DeepSeek's FULL verify graphs, whose aranges are freed mid-capture.)"""
    x = torch.zeros(64)
    graph = RecordedGraph(constants=[], persistent=[x])

    def forward() -> torch.Tensor:
        kept = []
        for _ in range(200):  # until the allocator hands a freed constant's memory back
            constant = torch.arange(64.0) + 0
            address = constant.data_ptr()
            del constant
            produced = x * 2
            if produced.data_ptr() == address:
                break
            kept.append(produced)
        return produced + 1

    out = graph.capture(forward)
    x.copy_(torch.ones(64))
    graph.replay({})
    assert out.eq(3).all()
