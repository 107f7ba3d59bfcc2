"""The CUDA backend: ``torch.cuda.CUDAGraph`` segments sharing one memory pool.

Capture first runs the function once under the recorded backend. That run is the
warm-up a CUDA graph needs (it loads kernels and settles the allocator), and it is the
linter: host syncs, data-dependent shapes and undeclared inputs fail here exactly as
they do on the CPU. Then the function runs again under CUDA graph capture.

A task has host-side parameters, which a graph cannot hold: capture ends the current
graph before it, runs it eagerly, and begins the next graph after it. A graph with no
task is one FULL graph (what it reads per step is in its static inputs); otherwise it
is PIECEWISE, and replay runs the segments with the tasks between them. Every segment
of every bucket shares one memory pool, captured largest bucket first, so the small
buckets reuse the large one's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from updraft.graph.recorded import RecordedGraph
from updraft.graph.recorded_nodes import TaskNode
from updraft.graph.tasks import recording_tasks
from updraft.graph.weakref import weak_ref_tensors


class CudaGraph:
    def __init__(
        self,
        constants: Iterable[torch.Tensor],
        persistent: Iterable[torch.Tensor],
        module_names: dict[int, str] | None = None,
        pool: Any = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA graph backend needs a CUDA device")
        self.lint = RecordedGraph(constants, persistent, module_names)
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.tasks: list[TaskNode] = []
        self.stream: torch.cuda.Stream | None = None

    @property
    def mode(self) -> str:
        return "PIECEWISE" if self.tasks else "FULL"

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.lint.capture(fn)  # warm-up and linter; raises CaptureError
        torch.cuda.synchronize()
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream), recording_tasks(self):
            self._begin_segment()
            out = fn()
            self.segments[-1].capture_end()
        torch.cuda.synchronize()
        # The pool, not this output, owns its memory: smaller buckets may reuse it, so
        # callers copy what they need right after each replay.
        return weak_ref_tensors(out)

    def _begin_segment(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.segments.append(graph)

    def record_task(
        self, op: Callable[..., Any], kwargs: dict[str, Any], key: Hashable
    ) -> torch.Tensor:
        self.segments[-1].capture_end()
        with recording_tasks(None):
            out = op(**kwargs)
        self.tasks.append(TaskNode(op, kwargs, key, out))
        self._begin_segment()
        return out

    def replay(self, task_kwargs: dict[str, Any], live_rows: int | None = None) -> None:
        """``task_kwargs`` updates the kwargs of every task. ``live_rows`` is not read:
        a device graph runs every captured row."""
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < len(self.tasks):
                task = self.tasks[i]
                task.output.copy_(task.op(**{**task.kwargs, **task_kwargs}))
