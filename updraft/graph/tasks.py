"""Tasks: captured ops whose host-side parameters change every step.

An op such as CPU attention takes per-request lengths as host lists. A device graph
would bake those lists in; instead the op calls ``register_task`` with the provider
that knows how to produce fresh parameters from a step's metadata. Outside a capture,
``register_task`` simply runs the op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol


class ParamProvider(Protocol):
    """A small frozen dataclass (hashable) naming one source of per-step parameters,
    e.g. ``AttentionParams(layer="model.layers.3.self_attn")``.

    A provider whose ``resolve`` returns only device tensors may set the class attribute
    ``device_params = True``: a CUDA graph then keeps its task inside the graph and
    refreshes the tensors by copy, instead of splitting the graph around it."""

    def resolve(self, metadata: Any) -> dict[str, Any]: ...


class TaskRecorder(Protocol):
    def record_task(
        self, op: Callable[..., Any], kwargs: dict[str, Any], provider: ParamProvider
    ) -> Any: ...


_recorder: ContextVar[TaskRecorder | None] = ContextVar("updraft_task_recorder", default=None)


def register_task(op: Callable[..., Any], kwargs: dict[str, Any], provider: ParamProvider) -> Any:
    """Run ``op(**kwargs)``; inside a capture, also record it as a task re-run at every
    replay with ``kwargs`` updated from ``provider.resolve(metadata)``."""
    recorder = _recorder.get()
    if recorder is None:
        return op(**kwargs)
    return recorder.record_task(op, kwargs, provider)


@contextmanager
def recording_tasks(recorder: TaskRecorder | None) -> Iterator[None]:
    """Route ``register_task`` calls to ``recorder`` (None: run ops plainly)."""
    token = _recorder.set(recorder)
    try:
        yield
    finally:
        _recorder.reset(token)
