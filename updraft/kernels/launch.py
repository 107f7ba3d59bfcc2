"""What every kernel op shares: its checked call as a ``Launch`` (the C function with
every argument fixed, which a replayed graph re-runs directly), the checks of its
arguments, and the definition of the op itself (schema, CPU kernel, Meta kernel)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

POINTER = ctypes.c_void_p
INT = ctypes.c_int64

_FRAGMENT = torch.library.Library("updraft", "FRAGMENT")


def define_op(schema: str, cpu: Callable[..., Any], meta: Callable[..., Any]) -> None:
    """An ``updraft::`` op: its schema, its CPU kernel and its shape-only Meta kernel."""
    name = schema.split("(", 1)[0]
    _FRAGMENT.define(schema)
    _FRAGMENT.impl(name, cpu, "CPU")
    _FRAGMENT.impl(name, meta, "Meta")


def check(condition: bool, op: str, what: str) -> None:
    if not condition:
        raise TypeError(f"updraft::{op} takes {what}")


def pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def writable_output(out: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether a kernel can write its float32 result of ``shape`` into ``out``."""
    return out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()


def reads_copies(
    given: tuple[torch.Tensor | None, ...], used: tuple[torch.Tensor | None, ...]
) -> bool:
    """Whether any tensor the call reads is a copy of the one it was given."""
    return any(a is not b for a, b in zip(given, used, strict=True))


@dataclass(frozen=True)
class Launch:
    """One kernel call, checked, with every argument fixed: the addresses of the tensors
    it reads and writes, and its sizes. An op runs its launch once; a replayed graph
    re-runs it on the very tensors it was captured with (``kernels/bound_calls.py``),
    without the dispatcher or the checks. ``reads`` holds every tensor whose address is
    among the arguments (a contiguous copy made here would otherwise be freed before the
    call). ``copied_inputs``: the call reads such a copy (an input was not contiguous),
    so re-running it would read that copy, not the refreshed original."""

    function: Callable[..., None]
    arguments: tuple[Any, ...]
    outputs: tuple[torch.Tensor, ...]
    reads: tuple[torch.Tensor | None, ...]
    copied_inputs: bool
    # Where the arguments hold the row count of a call whose rows are independent of
    # each other (row r of the output reads row r of the input alone), so that the call
    # may run over leading rows only (``leading_rows``).
    rows_argument: int | None = None

    def __post_init__(self) -> None:
        # Each argument made its C type once: ctypes would otherwise convert every Python
        # int again at each call, about half of a small launch's cost.
        types = getattr(self.function, "argtypes", None)
        arguments = (
            self.arguments
            if not types
            else tuple(kind(value) for kind, value in zip(types, self.arguments, strict=True))
        )
        object.__setattr__(self, "_converted", arguments)
        object.__setattr__(self, "_call", partial(self.function, *arguments))

    def __call__(self) -> Any:
        self._call()
        return self.outputs

    @property
    def rows(self) -> int | None:
        """The rows the launch runs over, where they are independent, else None."""
        return None if self.rows_argument is None else self.arguments[self.rows_argument]

    def leading_rows(self, rows: int) -> None:
        """The call over its first ``rows`` rows only (at most ``self.rows``): the other
        rows of its outputs keep what they held."""
        index = self.rows_argument
        if index is None or not 0 <= rows <= self.arguments[index]:
            raise ValueError(f"a launch over {self.rows} rows cannot run over {rows}")
        arguments = self._converted
        self.function(*arguments[:index], rows, *arguments[index + 1 :])
