"""Tasks: captured ops whose host-side parameters change every step.

An op such as CPU attention takes per-request lengths as host lists. A device graph
would bake those lists in; instead the op calls ``register_task``, and every replay
re-runs it with the kwargs its graph's ``task_kwargs`` hook makes fresh from that step
(``UpdatableGraph``). Outside a capture, ``register_task`` simply runs the op.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol


class TaskRecorder(Protocol):
    def record_task(self, op: Callable[..., Any], kwargs: dict[str, Any], key: Hashable) -> Any: ...


_recorder: ContextVar[TaskRecorder | None] = ContextVar("updraft_task_recorder", default=None)


def register_task(op: Callable[..., Any], kwargs: dict[str, Any], key: Hashable) -> Any:
    """Run ``op(**kwargs)``; inside a capture, also record it as a task re-run at every
    replay with the step's fresh kwargs. ``key`` names who registers it (an attention
    layer's name): a capture takes one task per key, since a second one (the layer
    attending again, under other shapes) would be renewed with the same kwargs."""
    recorder = _recorder.get()
    if recorder is None:
        return op(**kwargs)
    return recorder.record_task(op, kwargs, key)


@contextmanager
def recording_tasks(recorder: TaskRecorder | None) -> Iterator[None]:
    """Route ``register_task`` calls to ``recorder`` (None: run ops plainly)."""
    token = _recorder.set(recorder)
    try:
        yield
    finally:
        _recorder.reset(token)
