"""``UpdatableGraph``: a captured step that refreshes everything that changes per step.

    graph = UpdatableGraph(backend, inputs=[StaticInput("slot_mapping", buf, fill, pad=-1)],
                           metadata=AttentionMetadata.from_step)
    out = graph.capture(lambda: model(...), step)   # ops call register_task(...) inside
    out = graph.replay(step)                        # the only way to run it again

``replay`` first computes everything it will need (every static input's values and
every task's parameters, each checked), and only then writes the buffers and replays.
A failure therefore leaves the graph and its buffers untouched.
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
        metadata: Callable[[Any], Any],
        live_rows: Callable[[Any], int] | None = None,
    ) -> None:
        """``live_rows``: how many of the captured token rows a step fills, for a backend
        whose row-wise kernels may skip the rest (a mixed step padded to its bucket)."""
        names = [static_input.name for static_input in inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"static input names repeat: {names}")
        self.backend = backend
        self.inputs = list(inputs)
        self.metadata = metadata
        self.live_rows = live_rows
        self.output: Any = None
        self.task_keys: list[frozenset[str]] = []

    def capture(self, fn: Callable[[], Any], step: Any) -> Any:
        """Fill the inputs from ``step``, then capture ``fn``. Each provider must own
        exactly one task; its parameter names are fixed from here on."""
        for static_input in self.inputs:
            static_input.refresh(static_input.values(step))
        self.output = self.backend.capture(fn)
        counts = Counter(task.provider for task in self.backend.tasks)
        repeated = [provider for provider, count in counts.items() if count != 1]
        if repeated:
            raise GraphReplayError(f"providers registered more than one task: {repeated}")
        metadata = self.metadata(step)
        self.task_keys = [frozenset(task.provider.resolve(metadata)) for task in self.backend.tasks]
        for task, keys in zip(self.backend.tasks, self.task_keys, strict=True):
            # A kwarg its provider does not renew is captured as it is: a tensor inside
            # an object would be read at replay without the graph knowing it reads it
            # (a compiled run would not write it, nor a CUDA graph keep it in its pool).
            kept = {name: value for name, value in task.kwargs.items() if name not in keys}
            hidden = tensors_hidden_in(kept)
            if hidden:
                raise GraphReplayError(
                    f"task {getattr(task.op, '__name__', task.op)} takes tensors inside "
                    f"{', '.join(hidden)}: pass them as arguments of their own"
                )
        return self.output

    def replay(self, step: Any) -> Any:
        values = [static_input.values(step) for static_input in self.inputs]
        params = self._resolve(self.metadata(step))
        try:
            self.backend.check(params)
        except (TypeError, ValueError) as error:
            raise GraphReplayError(str(error)) from error
        rows = None if self.live_rows is None else self.live_rows(step)
        for static_input, value in zip(self.inputs, values, strict=True):
            static_input.refresh(value)
        self.backend.replay(params, rows)
        return self.output

    def _resolve(self, metadata: Any) -> list[dict[str, Any]]:
        tasks = self.backend.tasks
        if len(tasks) != len(self.task_keys):
            raise GraphReplayError(f"{len(tasks)} tasks, but {len(self.task_keys)} captured")
        resolved = []
        for task, keys in zip(tasks, self.task_keys, strict=True):
            try:
                params = task.provider.resolve(metadata)
            except Exception as error:
                raise GraphReplayError(f"{task.provider} failed to resolve: {error}") from error
            if not isinstance(params, dict) or frozenset(params) != keys:
                got = sorted(params) if isinstance(params, dict) else type(params).__name__
                raise GraphReplayError(
                    f"{task.provider} resolved {got}, expected parameters {sorted(keys)}"
                )
            resolved.append(params)
        return resolved
