"""``UpdatableGraph``: a captured step that refreshes everything that changes per step.

    graph = UpdatableGraph(backend, inputs=[StaticInput("slot_mapping", buf, fill, pad=-1)],
                           task_kwargs=lambda step: {"metadata": AttentionMetadata.bind(...)})
    out = graph.capture(lambda: model(...), step)   # ops call register_task(...) inside
    out = graph.replay(step)                        # the only way to run it again

``replay`` first computes everything it will need (every static input's values and the
tasks' fresh kwargs, each checked), and only then writes the buffers and replays. A
failure therefore leaves the graph and its buffers untouched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from updraft.graph.recorded_nodes import tensors_hidden_in
from updraft.graph.static_input import StaticInput


class GraphReplayError(RuntimeError):
    """Replay refused before touching anything."""


class UpdatableGraph:
    def __init__(
        self,
        backend: Any,
        inputs: Sequence[StaticInput],
        task_kwargs: Callable[[Any], dict[str, Any]],
        live_rows: Callable[[Any], int] | None = None,
    ) -> None:
        """``task_kwargs``: the hook that makes, from a step, the kwargs every task takes
        fresh at its replay (attention's metadata). ``live_rows``: how many of the
        captured token rows a step fills, for a backend whose row-wise kernels may skip
        the rest (a mixed step padded to its bucket)."""
        names = [static_input.name for static_input in inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"static input names repeat: {names}")
        self.backend = backend
        self.inputs = list(inputs)
        self.task_kwargs = task_kwargs
        self.live_rows = live_rows
        self.output: Any = None
        self.fresh_names: frozenset[str] = frozenset()
        self.num_tasks = 0

    def capture(self, fn: Callable[[], Any], step: Any) -> Any:
        """Fill the inputs from ``step``, then capture ``fn``. Each key must own exactly
        one task, and every task take every fresh kwarg; their names are fixed here."""
        for static_input in self.inputs:
            static_input.refresh(static_input.values(step))
        self.output = self.backend.capture(fn)
        tasks = self.backend.tasks
        counts = Counter(task.key for task in tasks)
        repeated = [key for key, count in counts.items() if count != 1]
        if repeated:
            raise GraphReplayError(f"keys registered more than one task: {repeated}")
        self.fresh_names, self.num_tasks = frozenset(self.task_kwargs(step)), len(tasks)
        for task in tasks:
            name = getattr(task.op, "__name__", task.op)
            missing = self.fresh_names - task.kwargs.keys()
            if missing:
                raise GraphReplayError(f"task {name} takes no {', '.join(sorted(missing))}")
            # A kwarg the hook does not renew is captured as it is: a tensor inside an
            # object would be read at replay without the graph knowing it reads it (a
            # compiled run would not write it, nor a CUDA graph keep it in its pool).
            kept = {key: value for key, value in task.kwargs.items() if key not in self.fresh_names}
            hidden = tensors_hidden_in(kept)
            if hidden:
                raise GraphReplayError(
                    f"task {name} takes tensors inside {', '.join(hidden)}: "
                    "pass them as arguments of their own"
                )
        return self.output

    def replay(self, step: Any) -> Any:
        values = [static_input.values(step) for static_input in self.inputs]
        fresh = self._fresh(step)
        rows = None if self.live_rows is None else self.live_rows(step)
        for static_input, value in zip(self.inputs, values, strict=True):
            static_input.refresh(value)
        self.backend.replay(fresh, rows)
        return self.output

    def _fresh(self, step: Any) -> dict[str, Any]:
        tasks = len(self.backend.tasks)
        if tasks != self.num_tasks:
            raise GraphReplayError(f"{tasks} tasks, but {self.num_tasks} captured")
        if not tasks:  # a graph without tasks (FULL) reads none: the hook's work is skipped
            return {}
        try:
            fresh = self.task_kwargs(step)
        except Exception as error:
            raise GraphReplayError(f"the tasks' kwargs failed: {error}") from error
        if not isinstance(fresh, dict) or frozenset(fresh) != self.fresh_names:
            got = sorted(fresh) if isinstance(fresh, dict) else type(fresh).__name__
            raise GraphReplayError(f"fresh kwargs {got}, expected {sorted(self.fresh_names)}")
        return fresh
