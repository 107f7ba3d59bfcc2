"""Compiled runs: a recorded graph whose stretches of ops between tasks and in-place
writes are fused by inductor replays exactly what re-running the function computes."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_recorded_graph import scaled
from updraft.graph import compiled_runs
from updraft.graph.recorded import CaptureError, RecordedGraph
from updraft.graph.tasks import register_task
from updraft.kernels.launch import define_op


class Layer(torch.nn.Module):
    """Elementwise runs around in-place cache writes, one reading a view of a run's
    intermediate, the other a run's result that nothing but the write reads (a compiled
    run that dropped it as unused would write stale values), and a task whose input is
    another."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.inputs = torch.zeros(3, width)
        self.slots = torch.zeros(3, dtype=torch.long)
        self.cache = torch.zeros(10, width)

    def forward(self) -> torch.Tensor:
        hidden = torch.tanh(self.inputs * self.weight) + 1
        # The write reads the first two columns of the run's result, through a view.
        self.cache[:, :2].index_copy_(0, self.slots, hidden[:, :2])
        # Only this write reads the run's sigmoid: it is the run's last consumer.
        self.cache[:, 2:4].index_copy_(0, self.slots, torch.sigmoid(hidden[:, 2:4] * 3))
        hidden = register_task(scaled, {"x": hidden, "factor": 2.0}, "scale")
        return (torch.relu(hidden) * self.weight).sum(-1)

    def reference(self, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.inputs * self.weight) + 1
        written = torch.cat([hidden[:, :2], torch.sigmoid(hidden[:, 2:4] * 3)], dim=1)
        return (torch.relu(hidden * factor) * self.weight).sum(-1), written


class DispatchedOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def capture(model: Layer) -> tuple[RecordedGraph, torch.Tensor]:
    graph = RecordedGraph(
        constants=model.parameters(),
        persistent=[model.inputs, model.slots, model.cache],
        compile_runs=True,
    )
    return graph, graph.capture(model)


@torch.inference_mode()
def test_compiled_replay_equals_rerunning_the_function():
    torch.manual_seed(0)
    model = Layer(width=5)
    graph, out = capture(model)
    for factor in (3.0, -1.5, 0.5):
        model.inputs.copy_(torch.randn(3, 5))
        model.slots.copy_(torch.randperm(10)[:3])
        graph.replay({"factor": factor})
        expected, written = model.reference(factor)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(model.cache[model.slots, :4], written)


@torch.inference_mode()
def test_fused_ops_are_not_dispatched_one_by_one():
    model = Layer(width=6)
    graph, _ = capture(model)
    with DispatchedOps() as seen:
        graph.replay({"factor": 2.0})
    # The in-place write and the task stay calls of their own; tanh, relu and the sum
    # run inside inductor's kernels, out of the dispatcher's sight.
    assert "index_copy_.default" in seen.ops
    assert not {"tanh.default", "relu.default", "sum.dim_IntList"} & set(seen.ops), seen.ops


@torch.inference_mode()
def test_a_run_inductor_cannot_compile_replays_op_by_op(monkeypatch, caplog):
    from torch._inductor import compile_fx

    def refuse(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compile_fx, "compile_fx", refuse)
    monkeypatch.setattr(compiled_runs, "_compiled", {})
    monkeypatch.setattr(compiled_runs, "_kept", lambda key, inputs: None)
    torch.manual_seed(1)
    model = Layer(width=7)
    graph, out = capture(model)
    assert "left uncompiled (RuntimeError: no C++ compiler)" in caplog.text
    model.inputs.copy_(torch.randn(3, 7))
    graph.replay({"factor": 4.0})
    torch.testing.assert_close(out, model.reference(4.0)[0])


@torch.inference_mode()
def test_layers_of_the_same_shape_share_one_compiled_run(monkeypatch):
    monkeypatch.setattr(compiled_runs, "_compiled", {})
    for seed in (0, 1):
        torch.manual_seed(seed)
        capture(Layer(width=4))
    # One run before each cache write, one after the task; the second layer compiles
    # nothing new.
    assert len(compiled_runs._compiled) == 3


@torch.inference_mode()
def test_runs_call_inductor_directly_once_checked(monkeypatch):
    monkeypatch.setattr(compiled_runs, "_compiled", {})
    monkeypatch.setattr(compiled_runs, "_kept", lambda key, inputs: None)  # compiled here
    torch.manual_seed(2)
    model = Layer(width=4)
    # At capture the inputs may hold anything, NaNs too: a run's results are then NaNs,
    # which its check must still find rewritten.
    model.inputs.fill_(float("nan"))
    capture(model)
    # Every run passed the check: its direct call wrote what the wrapped call wrote.
    assert all(entry.direct is not None for entry in compiled_runs._compiled.values())


def test_a_direct_call_that_misses_a_target_keeps_the_wrapper():
    inputs = [torch.randn(6), torch.empty(6), torch.empty(3, dtype=torch.long)]

    def wrapped(x: torch.Tensor, out: torch.Tensor, count: torch.Tensor) -> None:
        out.copy_(x.exp())
        count.fill_(3)

    def writes_one_target(args: list[torch.Tensor]) -> None:
        args[1].copy_(args[0].exp())  # the integer target is left as it was

    wrapped.current_callable = writes_one_target
    targets = inputs[1:]
    assert compiled_runs._direct_call(wrapped, inputs, targets) is None
    # What the refused call left behind is written again by the wrapped one.
    torch.testing.assert_close(inputs[1], inputs[0].exp())
    assert inputs[2].tolist() == [3, 3, 3]

    def writes_both(args: list[torch.Tensor]) -> None:
        wrapped(*args)

    wrapped.current_callable = writes_both
    assert compiled_runs._direct_call(wrapped, inputs, targets) is writes_both


@torch.inference_mode()
def test_a_replay_allocates_no_buffers_and_calls_no_wrapper(monkeypatch):
    import sys

    monkeypatch.setattr(compiled_runs, "_compiled", {})
    torch.manual_seed(3)
    model = Layer(width=4)
    graph, out = capture(model)
    seen: list[str] = []

    def watch(frame, event, arg):
        # inductor's buffer allocations and views of them, builtins known by name
        if event == "c_call" and arg.__name__ in ("_empty_strided_cpu", "_reinterpret_tensor"):
            seen.append(arg.__name__)
        elif event == "call" and frame.f_code.co_name == "call":  # an inductor wrapper
            seen.append(frame.f_code.co_filename)

    model.inputs.copy_(torch.randn(3, 4))
    sys.setprofile(watch)
    try:
        graph.replay({"factor": 2.5})
    finally:
        sys.setprofile(None)
    # The runs' kernels were bound at capture to buffers kept from then.
    assert not seen, seen
    torch.testing.assert_close(out, model.reference(2.5)[0])


define_op("test_doubled(Tensor x) -> Tensor", lambda x: x * 2, lambda x: torch.empty_like(x))


class AroundAnUpdraftOp(torch.nn.Module):
    """Elementwise runs on each side of one of updraft's own ops."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.inputs = torch.zeros(2, width)

    def forward(self) -> torch.Tensor:
        doubled = torch.ops.updraft.test_doubled(torch.tanh(self.inputs * self.weight) + 1)
        return torch.relu(doubled - self.weight).sum(-1) * 3

    def reference(self) -> torch.Tensor:
        doubled = (torch.tanh(self.inputs * self.weight) + 1) * 2
        return torch.relu(doubled - self.weight).sum(-1) * 3


@torch.inference_mode()
def test_updrafts_own_ops_stay_out_of_runs_so_every_run_is_its_kernel_calls(monkeypatch):
    """Inductor would call the op from its wrapper, and a wrapper that does more than
    call its kernels can be neither bound nor kept for a later start."""
    monkeypatch.setattr(compiled_runs, "_compiled", {})
    monkeypatch.setattr(compiled_runs, "_kept", lambda key, inputs: None)  # compiled here
    torch.manual_seed(4)
    model = AroundAnUpdraftOp(width=6)
    graph = RecordedGraph(
        constants=model.parameters(), persistent=[model.inputs], compile_runs=True
    )
    out = graph.capture(model)
    assert len(compiled_runs._compiled) == 2
    assert all(entry.calls is not None for entry in compiled_runs._compiled.values())
    with DispatchedOps() as seen:
        model.inputs.copy_(torch.randn(2, 6))
        graph.replay({})
    assert "test_doubled.default" in seen.ops and "tanh.default" not in seen.ops
    torch.testing.assert_close(out, model.reference())


class ARouter(torch.nn.Module):
    """A mixture's router: a matmul, a top-k, a sort and a scatter of counts (each an
    extern call in inductor's wrapper on the CPU) between elementwise runs."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.randn(experts, width))
        self.inputs = torch.zeros(5, width)

    def forward(self) -> torch.Tensor:
        chosen = torch.tanh(self.inputs * 2) @ self.gate.t()
        top = (chosen.softmax(-1) + 1).topk(2, dim=-1).indices.flatten()
        order = torch.argsort(top, stable=True)
        counts = torch.zeros(self.gate.shape[0], dtype=torch.int64).scatter_add(
            0, top, torch.ones_like(top)
        )
        return (order // 2 + counts.cumsum(0).sum()) * 3 + 1


@torch.inference_mode()
def test_extern_ops_stay_out_of_runs_so_every_run_is_its_kernel_calls(monkeypatch):
    """An op inductor calls from its wrapper (BLAS, sort, top-k, scan, scatter) would
    leave a run that can be neither bound nor kept: a MoE model compiled its router's
    runs again at every start, importing inductor."""
    monkeypatch.setattr(compiled_runs, "_compiled", {})
    monkeypatch.setattr(compiled_runs, "_kept", lambda key, inputs: None)  # compiled here
    torch.manual_seed(5)
    model = ARouter(width=8, experts=4)
    graph = RecordedGraph(
        constants=model.parameters(), persistent=[model.inputs], compile_runs=True
    )
    out = graph.capture(model)
    assert compiled_runs._compiled
    assert all(entry.calls is not None for entry in compiled_runs._compiled.values())
    for _ in range(2):
        model.inputs.copy_(torch.randn(5, 8))
        graph.replay({})
        torch.testing.assert_close(out, model())


def test_finishing_makes_each_index_call_once_in_order():
    """A run's check reads what the calls before it wrote: ops outside the runs whose
    results are integers are made while finishing, or a later run's check reads them as
    whatever memory held (a mixture's order of expert rows, out of range, aborted the
    process inside inductor's kernel). Float ops (a bucket's matrix products) are not."""
    made: list[str] = []
    first = compiled_runs.IndexCall(lambda: made.append("order"))
    product = lambda: made.append("matrix product")  # noqa: E731
    last = compiled_runs.IndexCall(lambda: made.append("offsets"))
    finished = compiled_runs.finished([[first, product], [last]])
    assert made == ["order", "offsets"]
    assert finished == [[first.call, product], [last.call]]  # replayed without the wrapper


@torch.inference_mode()
def test_a_graph_placed_op_by_op_refuses_to_compile_its_runs():
    """Its arena lets a result take the bytes of what the op before it read; fused into
    one run, the result would overwrite what the run still has to read."""
    model = Layer(width=4)
    graph = RecordedGraph(
        constants=model.parameters(), persistent=[model.inputs, model.slots, model.cache]
    )
    graph.capture(model)
    with pytest.raises(CaptureError, match="without compile_runs"):
        graph.compile()
