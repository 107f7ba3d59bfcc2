"""A compiled run's kernels bound once to its tensors, without inductor's Python wrapper.

Inductor's wrapper (the ``call`` of its generated module) does the same at every call:
it unpacks its arguments, allocates the buffers its kernels pass between each other
(``empty_strided_cpu``; views of them, ``reinterpret_tensor``), calls its C++ kernels
and drops everything. A compiled run is always called with the same tensors, so that
work can be done once: the wrapper is run once with its kernels recorded, and the run
replays as those kernel calls with the same arguments. The buffers it allocated are kept,
one set per run, and rewritten at each call as fresh ones would be (inductor never reads
a buffer before its kernels write it). A decode step saves about 97 wrapper calls and
240 allocations.

Only a wrapper made of nothing else is bound this way (its code names nothing but the
allocations, its kernels and the names they need); one that calls anything more (an
extern kernel, the dispatcher) keeps its wrapper. So does a run whose buffers are larger
than ``MAX_KEPT_BYTES``: a mixed step's buffers hold its hundreds of tokens, and an
allocation is cheap against the work done on them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

# The buffers one run may keep between calls.
MAX_KEPT_BYTES = 64 * 1024

KERNEL_PREFIX = "cpp_fused_"
ALLOCATIONS = ("empty_strided_cpu", "reinterpret_tensor")
# What else a wrapper of allocations and kernel calls names: its argument list, the
# dtypes and sizes of its buffers.
PLAIN_NAMES = frozenset(
    {"clear", "torch", "size", "float32", "float64", "bfloat16", "float16", "int64", "int32"}
    | {"int16", "int8", "uint8", "bool", *ALLOCATIONS}
)


def frozen_call(direct: Callable[[list[torch.Tensor]], Any], inputs: list[torch.Tensor]) -> Any:
    """``direct`` (inductor's wrapper) called once with ``inputs``, and its kernel calls
    bound to the arguments they got: a callable that repeats them, or None where the
    wrapper does more than allocate and call its kernels, or its buffers are too large."""
    function = getattr(direct, "__func__", direct)
    if not isinstance(function, types.FunctionType) or not plain_wrapper(function):
        return None
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    allocated = [0]
    names = dict(function.__globals__)

    def recording(kernel: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any) -> Any:
            calls.append((kernel, args))
            return kernel(*args)

        return record

    def counted_empty(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        buffer = function.__globals__["empty_strided_cpu"](size, stride, dtype)
        allocated[0] += buffer.untyped_storage().nbytes()
        return buffer

    for name in function.__code__.co_names:
        if name.startswith(KERNEL_PREFIX):
            names[name] = recording(function.__globals__[name])
    names["empty_strided_cpu"] = counted_empty
    # A copy of the wrapper over these names, so other runs calling the module's own
    # wrapper meanwhile (in another runner's thread) are left alone.
    recorder = types.FunctionType(function.__code__, names, function.__name__)
    owner = getattr(direct, "__self__", None)
    recorder(*([] if owner is None else [owner]), list(inputs))
    if not calls or allocated[0] > MAX_KEPT_BYTES:
        return None
    if len(calls) == 1:
        return partial(calls[0][0], *calls[0][1])
    bound = [partial(kernel, *args) for kernel, args in calls]
    return partial(_call_each, bound)


def plain_wrapper(function: types.FunctionType) -> bool:
    """Whether ``function`` names nothing but allocations, its C++ kernels and their
    arguments' dtypes: then calling it again does exactly what its kernels do."""
    kernels = [name for name in function.__code__.co_names if name.startswith(KERNEL_PREFIX)]
    if not kernels or any(name not in function.__globals__ for name in kernels):
        return False
    if any(isinstance(const, types.CodeType) for const in function.__code__.co_consts):
        return False  # a nested function or comprehension: more than straight calls
    others = set(function.__code__.co_names) - set(kernels)
    return others <= PLAIN_NAMES


def _call_each(calls: list[Callable[[], Any]]) -> None:
    for call in calls:
        call()
