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

import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from updraft.graph.arena import SharedArena, place_in_arena
from updraft.graph.compile_cache import compiling, open_cache
from updraft.graph.compiled_runs import compiled_segments, finished, replay_calls
from updraft.graph.intermediates import Intermediates
from updraft.graph.recorded_nodes import (
    OpNode,
    TaskNode,
    TokenRows,
    bind,
    find_out_variant,
    storage_of,
    tensors_in,
)
from updraft.graph.tasks import recording_tasks

HOST_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default}
SHAPE_FROM_DATA = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


class CaptureError(RuntimeError):
    """The captured function does something a graph cannot replay faithfully."""


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps ``__torch_dispatch__`` in ``torch._disable_dynamo``, whose
        # first call imports dynamo, and with it sympy and much of inductor (about 65
        # MiB resident), into a process that may never compile. Nothing traces the
        # recorder with dynamo: compiled runs are built from its nodes afterwards.
        return False

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
        inputs = tensors_in((args, kwargs))
        self.graph.check_inputs(func, inputs, where)
        out = func(*args, **kwargs)
        self.graph.record_op(func, args, kwargs, inputs, out)
        return out


class RecordedGraph:
    """One captured function. ``constants`` are tensors it may read without producing
    them and that never change between replays of a step (weights); ``persistent`` are
    tensors it may read and write that live across steps (KV cache, static inputs).
    ``compile_runs`` replays the stretches of ops between tasks as inductor-compiled
    kernels (``compiled_runs.py``) instead of op by op; with ``defer_compile`` it replays
    op by op until ``compile`` has made them and ``swap`` put them in. ``token_rows``:
    the token rows a mixed step is captured over, of which each replay may fill fewer
    (``replay``)."""

    def __init__(
        self,
        constants: Iterable[torch.Tensor],
        persistent: Iterable[torch.Tensor],
        module_names: dict[int, str] | None = None,
        compile_runs: bool = False,
        token_rows: int | None = None,
        defer_compile: bool = False,
        arenas: SharedArena | None = None,
    ) -> None:
        self.constant_storages = {storage_of(t) for t in constants}
        # What ops on constants alone produced (an arange, a mask of aranges): kept
        # alive, since storages are told apart by address. Freed, its memory could
        # hold a tensor produced later, which would then pass for a constant and be
        # baked into the graph with the capture's values.
        self.folded: list[torch.Tensor] = []
        self.folded_storages: set[int] = set()
        self.persistent_storages = {storage_of(t) for t in persistent}
        self.produced: set[int] = set()
        self.nodes: list[OpNode | TaskNode] = []
        self.tasks: list[TaskNode] = []  # the task nodes, in order
        self.module_names = module_names or {}
        self.module_stack: list[str] = []
        self.undeclared: list[str] = []
        self.compile_runs, self.defer_compile = compile_runs, defer_compile
        self.token_rows = None if token_rows is None else TokenRows(token_rows)
        self.output_storages: set[int] = set()
        self.arena: torch.Tensor | None = None  # the produced tensors' memory (arena.py)
        self.arenas = arenas  # whose block the arena is the head of, if shared
        # While capturing: the produced storages, freed as the forward drops them.
        self.intermediates: Intermediates | None = None
        self._segments: list[list[Callable[[], Any]]] | None = None

    @property
    def mode(self) -> str:
        """FULL: one graph, nothing between segments; PIECEWISE: tasks between them."""
        return "PIECEWISE" if self.tasks else "FULL"

    # -- capture -----------------------------------------------------------------------

    def capture(self, fn: Callable[[], Any]) -> Any:
        # The module hooks are process-wide: a capture in a thread of its own names the
        # modules of its own forward, not those of the steps that run beside it.
        self.capturing_thread = threading.get_ident()
        hooks = (
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave),
        )
        self.intermediates = Intermediates(self.constant_storages | self.persistent_storages)
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
        self.output_storages = {storage_of(tensor) for tensor in tensors_in(out)}
        # Placed for compiled runs even before they are compiled: a run's results then
        # never share bytes with what it reads, and op by op every life is a subset of that.
        intermediates, self.intermediates = self.intermediates, None
        self.arena = place_in_arena(
            self.nodes,
            self._calls(),
            self._movable() | intermediates.freed_keys(),
            self.arenas,
            key=intermediates.key,
            nbytes=intermediates.nbytes,
        )
        if self.compile_runs and not self.defer_compile:  # the first replay should not wait
            with compiling(open_cache()):
                self.swap(self.compile())
        return out

    def _movable(self) -> set[int]:
        """The storages the graph produced for itself: not returned, not a view of a
        weight, the KV cache or an input; each is rewritten at every replay before it is
        read, so it may share memory with any whose replay calls it does not meet. (Those
        freed while capturing are known by their own keys: ``Intermediates``.)"""
        kept = self.output_storages | self.constant_storages | self.persistent_storages
        return {storage for storage in self.produced - kept if storage != 0}

    def _calls(self) -> list[int]:
        """For each node, the replay call it runs in (a compiled run is one call)."""
        if not self.compile_runs:
            return list(range(len(self.nodes)))
        calls = [0] * len(self.nodes)
        for number, call in enumerate(replay_calls(self.nodes)):
            for index in call:
                calls[index] = number
        return calls

    def _enter(self, module: torch.nn.Module, _inputs: Any) -> None:
        if threading.get_ident() != self.capturing_thread:
            return
        self.module_stack.append(self.module_names.get(id(module), type(module).__name__))

    def _leave(self, _module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        if threading.get_ident() == self.capturing_thread:
            self.module_stack.pop()

    def location(self) -> str:
        return self.module_stack[-1] if self.module_stack else "(top level)"

    def check_inputs(self, func: Any, inputs: list[torch.Tensor], where: str) -> None:
        """Names each of the tensors ``func`` reads that is none of the graph's own."""
        for tensor in inputs:
            storage = storage_of(tensor)
            if not (
                storage in self.produced
                or storage in self.constant_storages
                or storage in self.persistent_storages
            ):
                self.undeclared.append(
                    f"{func} at {where} reads a {tuple(tensor.shape)} {tensor.dtype} tensor"
                )
                self.produced.add(storage)  # report each tensor once

    def record_op(
        self, func: Any, args: Any, kwargs: Any, inputs: list[torch.Tensor], out: Any
    ) -> None:
        outputs = tensors_in(out)
        reads_only_constants = all(storage_of(t) in self.constant_storages for t in inputs)
        mutates = func._schema.is_mutable
        if reads_only_constants and not mutates:
            self.constant_storages.update(storage_of(t) for t in outputs)
            self.folded_storages.update(storage_of(t) for t in outputs)
            self.folded.extend(outputs)
            return
        if mutates:
            self.check_writes(func, args, kwargs)
        self.produced.update(storage_of(t) for t in outputs)
        # An op whose schema allows aliasing (to, reshape, contiguous) returns a view
        # only sometimes: whether it did is in the storages, and a copy must re-run.
        read = {storage_of(t) for t in inputs}
        is_view = func.is_view and all(storage_of(t) in read for t in outputs)
        rerun = mutates or not is_view
        out_variant = find_out_variant(func) if rerun and len(outputs) == 1 else None
        held = self.intermediates
        held.track(outputs)
        args, kwargs, kept = held.held((args, kwargs, [] if mutates else outputs))
        self.nodes.append(OpNode(func, args, kwargs, kept, rerun, out_variant))
        self._free_dead()

    def _free_dead(self) -> None:
        """Frees what the forward let go of; its address may now go to a new tensor,
        which must not pass for this one."""
        self.produced.difference_update(self.intermediates.free_dead())

    def check_writes(self, func: Any, args: Any, kwargs: Any) -> None:
        """Refuses a write into a tensor made from constants alone (``torch.zeros``):
        the graph folded it, and what later ops read of it, as values of the capture,
        so every replay would read the capture's values and not the write's."""
        written = [
            args[index] if index < len(args) else kwargs.get(argument.name)
            for index, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ]
        for tensor in tensors_in(written):
            if storage_of(tensor) in self.folded_storages:
                raise CaptureError(
                    f"{func} at {self.location()} writes into a {tuple(tensor.shape)} tensor "
                    "made from constants alone (torch.zeros, torch.empty, ...), which the graph "
                    "holds as a constant: make it from a tensor of the step (new_zeros)"
                )

    def record_task(
        self, op: Callable[..., Any], kwargs: dict[str, Any], key: Hashable
    ) -> torch.Tensor:
        self.check_inputs(op, tensors_in(kwargs), self.location())
        with _disable_current_modes(), recording_tasks(None):
            out = op(**kwargs)
        if not isinstance(out, torch.Tensor):
            raise CaptureError(f"task {op.__name__} must return one tensor")
        self.produced.add(storage_of(out))
        with _disable_current_modes():  # the aliases are no ops of the graph
            self.intermediates.track([out])
            held_kwargs, held_out = self.intermediates.held((kwargs, out))
        task = TaskNode(op, held_kwargs, key, held_out)
        self.nodes.append(task)
        self.tasks.append(task)
        self._free_dead()
        return out

    # -- replay ------------------------------------------------------------------------

    def segments(self) -> list[list[Callable[[], Any]]]:
        """The ops to re-run, bound to their tensors, split at the tasks: segment i runs
        before task i, and the last segment after the last task. Built once (op by op,
        until ``swap`` puts compiled ones in)."""
        if self._segments is None:
            self._segments = [[]]
            for node in self.nodes:
                if isinstance(node, TaskNode):
                    self._segments.append([])
                elif node.rerun:
                    self._segments[-1].append(bind(node, self.token_rows))
        return self._segments

    def compile(self) -> list[list[Any]]:
        """The segments with each run of ops compiled, not yet callable: ``swap`` finishes
        them. Reads only the recorded nodes, so it may run beside replays, in a thread.
        Only for a graph captured with ``compile_runs``: its arena counts lives in runs."""
        if not self.compile_runs:
            # Placed op by op, a run's result may share bytes with what the same run
            # reads: fused, it would overwrite an index before reading it.
            raise CaptureError("a graph captured without compile_runs cannot compile its runs")
        return compiled_segments(self.nodes, self.output_storages, self.token_rows, finish=False)

    def swap(self, segments: list[list[Any]]) -> None:
        """Replay ``compile``'s segments from now on. Between replays only: finishing a
        run checks it by running it."""
        self._segments = finished(segments)
        # The compiled runs hold the tensors they read and write; what the fused ops
        # produced in between was only held by their nodes, and can go.
        self.nodes = []

    def replay(self, task_kwargs: dict[str, Any], live_rows: int | None = None) -> None:
        """Re-run the recorded ops; ``task_kwargs`` updates the kwargs of every task.
        ``live_rows``: of a mixed step's token rows, how many hold its tokens (the row-wise
        kernels run over those alone)."""
        if self.token_rows is not None:
            self.token_rows.live = self.token_rows.captured if live_rows is None else live_rows
        for i, segment in enumerate(self.segments()):
            for call in segment:
                call()
            if i < len(self.tasks):
                task = self.tasks[i]
                task.output.copy_(task.op(**{**task.kwargs, **task_kwargs}))
