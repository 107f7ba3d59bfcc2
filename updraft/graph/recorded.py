"""The recorded backend: a CPU stand-in for a device graph, and a linter for graph safety.

Capture runs the function once under a ``TorchDispatchMode`` that records every aten op
with the very tensors and scalars it saw, as a device graph bakes them. Replay re-runs
the recorded ops on the same tensors, writing each result into the tensor captured as
that op's output, so downstream ops read it at the same address. Views alias memory that
is refreshed in place and ops on constants (weights) give the same result, so neither is
re-run. Tasks are re-run with fresh host-side parameters.

Replay runs the recorded ops as segments of pre-bound calls with the tasks between
them, the same shape a piecewise device graph has.

Capture refuses what a device graph cannot hold: host syncs (``.item()``, ``.tolist()``,
``bool(tensor)``) and ops whose output shape depends on data. And it refuses any tensor
the graph reads that it did not produce and that is not a weight, KV cache or declared
static input: such a tensor would be replayed stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from updraft.graph.tasks import ParamProvider, recording_tasks

HOST_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default}
SHAPE_FROM_DATA = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


class CaptureError(RuntimeError):
    """The captured function does something a graph cannot replay faithfully."""


@dataclass
class OpNode:
    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]  # captured results that replay writes into
    rerun: bool
    out_variant: torch._ops.OpOverload | None = None  # writes straight into outputs[0]


def _out_variant(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``func``'s ``out=`` overload when it has the same arguments plus one ``out``."""
    candidate = getattr(func.overloadpacket, "out", None)
    if candidate is None or func._schema.is_mutable:
        return None
    names = [a.name for a in func._schema.arguments]
    out_names = [a.name for a in candidate._schema.arguments if not a.is_out]
    outs = [a for a in candidate._schema.arguments if a.is_out]
    return candidate if names == out_names and len(outs) == 1 and outs[0].name == "out" else None


@dataclass
class TaskNode:
    op: Callable[..., Any]
    kwargs: dict[str, Any]
    provider: ParamProvider
    output: torch.Tensor


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> int:
    if tensor.is_mkldnn:  # an opaque prepacked weight has no storage: it names itself
        return id(tensor)
    return tensor.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = self.graph.location()
        if func in HOST_SYNC_OPS:
            raise CaptureError(
                f"{func} at {where} syncs with the host (.item(), .tolist(), bool(tensor)); "
                "a captured graph would replay the value seen at capture"
            )
        if any(tag in func.tags for tag in SHAPE_FROM_DATA):
            raise CaptureError(
                f"{func} at {where} has an output shape that depends on tensor data; "
                "a captured graph has fixed shapes"
            )
        self.graph.check_inputs(func, args, kwargs, where)
        out = func(*args, **kwargs)
        self.graph.record_op(func, args, kwargs, out)
        return out


class RecordedGraph:
    """One captured function. ``constants`` are tensors it may read without producing
    them and that never change between replays of a step (weights); ``persistent`` are
    tensors it may read and write that live across steps (KV cache, static inputs)."""

    def __init__(
        self,
        constants: Iterable[torch.Tensor],
        persistent: Iterable[torch.Tensor],
        module_names: dict[int, str] | None = None,
    ) -> None:
        self.constant_storages = {_storage(t) for t in constants}
        self.persistent_storages = {_storage(t) for t in persistent}
        self.produced: set[int] = set()
        self.nodes: list[OpNode | TaskNode] = []
        self.tasks: list[TaskNode] = []  # the task nodes, in order
        self.module_names = module_names or {}
        self.module_stack: list[str] = []
        self.undeclared: list[str] = []
        self._segments: list[list[Callable[[], Any]]] | None = None

    # -- capture -----------------------------------------------------------------------

    def capture(self, fn: Callable[[], Any]) -> Any:
        hooks = (
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave),
        )
        try:
            with recording_tasks(self), _Recorder(self):
                out = fn()
        finally:
            for hook in hooks:
                hook.remove()
        if self.undeclared:
            raise CaptureError(
                "the graph reads tensors that are neither produced inside it nor declared "
                "(weights, KV cache or StaticInput); they would be replayed stale:\n  "
                + "\n  ".join(self.undeclared)
            )
        return out

    def _enter(self, module: torch.nn.Module, _inputs: Any) -> None:
        self.module_stack.append(self.module_names.get(id(module), type(module).__name__))

    def _leave(self, _module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        self.module_stack.pop()

    def location(self) -> str:
        return self.module_stack[-1] if self.module_stack else "(top level)"

    def check_inputs(self, func: Any, args: Any, kwargs: Any, where: str) -> None:
        allowed = self.produced | self.constant_storages | self.persistent_storages
        for tensor in _tensors((args, kwargs)):
            if _storage(tensor) not in allowed:
                self.undeclared.append(
                    f"{func} at {where} reads a {tuple(tensor.shape)} {tensor.dtype} tensor"
                )
                allowed.add(_storage(tensor))  # report each tensor once
                self.produced.add(_storage(tensor))

    def record_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        outputs = _tensors(out)
        inputs = _tensors((args, kwargs))
        reads_only_constants = all(_storage(t) in self.constant_storages for t in inputs)
        mutates = func._schema.is_mutable
        if reads_only_constants and not mutates:
            self.constant_storages.update(_storage(t) for t in outputs)
            return
        self.produced.update(_storage(t) for t in outputs)
        rerun = mutates or not func.is_view
        out_variant = _out_variant(func) if rerun and len(outputs) == 1 else None
        self.nodes.append(
            OpNode(func, args, kwargs, [] if mutates else outputs, rerun, out_variant)
        )

    def record_task(
        self, op: Callable[..., Any], kwargs: dict[str, Any], provider: ParamProvider
    ) -> torch.Tensor:
        self.check_inputs(op, (), kwargs, self.location())
        with _disable_current_modes(), recording_tasks(None):
            out = op(**kwargs)
        if not isinstance(out, torch.Tensor):
            raise CaptureError(f"task {op.__name__} must return one tensor")
        self.produced.add(_storage(out))
        task = TaskNode(op, kwargs, provider, out)
        self.nodes.append(task)
        self.tasks.append(task)
        return out

    # -- replay ------------------------------------------------------------------------

    def segments(self) -> list[list[Callable[[], Any]]]:
        """The ops to re-run, bound to their tensors, split at the tasks: segment i runs
        before task i, and the last segment after the last task."""
        segments: list[list[Callable[[], Any]]] = [[]]
        for node in self.nodes:
            if isinstance(node, TaskNode):
                segments.append([])
            elif node.rerun:
                segments[-1].append(_bind(node))
        return segments

    def check(self, task_params: list[dict[str, Any]]) -> None:
        """Nothing to check: a re-run task takes whatever its provider resolves."""

    def replay(self, task_params: list[dict[str, Any]]) -> None:
        """Re-run the recorded ops; ``task_params[i]`` updates the kwargs of task i."""
        if self._segments is None:
            self._segments = self.segments()
        for i, segment in enumerate(self._segments):
            for call in segment:
                call()
            if i < len(self.tasks):
                task = self.tasks[i]
                task.output.copy_(task.op(**{**task.kwargs, **task_params[i]}))


def _bind(node: OpNode) -> Callable[[], Any]:
    """One recorded op as a call with no arguments that leaves its result in the
    captured output tensors. ``_op`` skips the Python wrapper of ``OpOverload``."""
    if node.out_variant is not None:
        return partial(node.out_variant._op, *node.args, **node.kwargs, out=node.outputs[0])
    run = partial(node.func._op, *node.args, **node.kwargs)
    if not node.outputs:  # an in-place op writes its targets itself
        return run
    outputs = node.outputs

    def run_and_copy() -> None:
        for captured, fresh in zip(outputs, _tensors(run()), strict=True):
            captured.copy_(fresh)

    return run_and_copy
