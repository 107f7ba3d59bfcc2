"""A compiled run's kernels bound once to its tensors, without inductor's Python wrapper.

Inductor's wrapper (the ``call`` of its generated module) does the same at every call:
it unpacks its arguments, allocates the buffers its kernels pass between each other
(``empty_strided_cpu``; views of them, ``reinterpret_tensor``), calls its C++ kernels
and drops everything. A compiled run is always called with the same tensors, so that
work can be done once.

``record`` calls the wrapper once with its kernels and allocations replaced by
recorders, so no kernel runs: what it keeps (``RunCalls``) names each kernel call's
arguments by where they come from (the run's i-th input, the j-th buffer the wrapper
allocated, a view of either, a number), never by the tensors of one run. That
description is what a later start loads from the compile cache without importing
inductor (``graph/run_store.py``). ``bind`` makes it callable over one run's tensors:

* a run whose buffers fit in ``MAX_KEPT_BYTES`` keeps one set of them and replays as
  its kernel calls with fixed arguments (inductor never reads a buffer before its
  kernels write it, so a kept buffer serves as a fresh one). A decode step saves about
  97 wrapper calls and 240 allocations;
* a larger run (a mixed step's buffers hold its hundreds of tokens, and an allocation
  is cheap against the work done on them) allocates its buffers at each call, as the
  wrapper did.

Only a wrapper made of nothing else is recorded (its code names nothing but the
allocations, its kernels and the names they need); one that calls anything more (an
extern kernel, the dispatcher) keeps its wrapper.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

# The buffers one run may keep between calls.
MAX_KEPT_BYTES = 64 * 1024

KERNEL_PREFIX = "cpp_fused_"
ALLOCATIONS = ("empty_strided_cpu", "reinterpret_tensor")
# What else a wrapper of allocations and kernel calls names: its argument list, the
# dtypes and sizes of its buffers, its inputs' sizes and strides (a graph inductor made
# for symbolic shapes reads them and passes them on as numbers: a run's inputs always
# have the same ones).
PLAIN_NAMES = frozenset(
    {"clear", "torch", "size", "stride", "float32", "float64", "bfloat16", "float16"}
    | {"int64", "int32", "int16", "int8", "uint8", "bool", *ALLOCATIONS}
)
BUFFER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)
BUFFER_DTYPES += (torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
DTYPES = {str(dtype): dtype for dtype in BUFFER_DTYPES}

# Where one argument of a kernel call comes from, as JSON can hold it:
#   ["input", i]                               the run's i-th input
#   ["buffer", j]                              the j-th buffer the wrapper allocates
#   ["view", base, size, stride, offset]       a view of ``base`` (itself an argument),
#                                              its storage offset ``offset`` past base's
#   ["int", n], ["float", x]                   a number
Source = list[Any]


class Buffer(NamedTuple):
    size: list[int]
    stride: list[int]
    dtype: str  # a key of DTYPES

    def nbytes(self) -> int:
        if 0 in self.size:
            return 0
        steps = zip(self.size, self.stride, strict=True)
        span = 1 + sum((size - 1) * stride for size, stride in steps)
        return span * DTYPES[self.dtype].itemsize


class KernelCall(NamedTuple):
    kernel: Callable[..., Any]
    arguments: list[Source]


class RunCalls(NamedTuple):
    """A compiled run as the calls its wrapper makes, over ``inputs`` input tensors."""

    inputs: int
    buffers: list[Buffer]
    calls: list[KernelCall]

    def kept_bytes(self) -> int:
        return sum(buffer.nbytes() for buffer in self.buffers)


def record(
    direct: Callable[[list[torch.Tensor]], Any], inputs: list[torch.Tensor]
) -> RunCalls | None:
    """The calls ``direct`` (inductor's wrapper) makes over ``inputs``, found by calling
    it with recorders in place of its kernels and allocations (no kernel runs, so this may
    run beside replays of the same tensors); None where the wrapper does more than
    allocate and call its kernels, or passes a kernel something ``Source`` cannot name."""
    function = getattr(direct, "__func__", direct)
    if not isinstance(function, types.FunctionType) or not plain_wrapper(function):
        return None
    sources: dict[int, Source] = {}
    for index in reversed(range(len(inputs))):  # an input given twice: the first
        sources[id(inputs[index])] = ["input", index]
    buffers: list[Buffer] = []
    made: list[torch.Tensor] = []  # kept alive, so no two of them share an id
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def empty_strided_cpu(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty_strided(size, stride, dtype=dtype)
        sources[id(buffer)] = ["buffer", len(buffers)]
        buffers.append(Buffer([int(s) for s in size], [int(s) for s in stride], str(dtype)))
        made.append(buffer)
        return buffer

    def reinterpret_tensor(base: torch.Tensor, size: Any, stride: Any, offset: int) -> torch.Tensor:
        view = _view(base, list(size), list(stride), int(offset))
        if id(base) in sources:
            sources[id(view)] = ["view", sources[id(base)], list(size), list(stride), offset]
        made.append(view)
        return view

    def recording(kernel: Callable[..., Any]) -> Callable[..., None]:
        def record_call(*args: Any) -> None:
            calls.append((kernel, args))

        return record_call

    names = dict(function.__globals__)
    for name in function.__code__.co_names:
        if name.startswith(KERNEL_PREFIX):
            names[name] = recording(function.__globals__[name])
    names["empty_strided_cpu"] = empty_strided_cpu
    names["reinterpret_tensor"] = reinterpret_tensor
    # A copy of the wrapper over these names, so other runs calling the module's own
    # wrapper meanwhile (in another runner's thread) are left alone.
    recorder = types.FunctionType(function.__code__, names, function.__name__)
    owner = getattr(direct, "__self__", None)
    recorder(*([] if owner is None else [owner]), list(inputs))
    described = []
    for kernel, args in calls:
        arguments = [_source(arg, sources) for arg in args]
        if any(source is None for source in arguments):
            return None
        described.append(KernelCall(kernel, arguments))
    if not described or any(dtype not in DTYPES for _, _, dtype in buffers):
        return None
    return RunCalls(len(inputs), buffers, described)


def _source(arg: Any, sources: dict[int, Source]) -> Source | None:
    if isinstance(arg, torch.Tensor):
        return sources.get(id(arg))
    if isinstance(arg, bool):
        return None
    if isinstance(arg, int):
        return ["int", arg]
    if isinstance(arg, float) and math.isfinite(arg):
        return ["float", arg]
    return None


def bind(run: RunCalls, inputs: list[torch.Tensor]) -> Callable[[], None]:
    """``run``'s calls over ``inputs``: with its buffers made once where they fit in
    ``MAX_KEPT_BYTES``, else made at each call."""
    if run.kept_bytes() > MAX_KEPT_BYTES:
        return partial(_allocate_and_call, run, inputs)
    calls = [partial(call.kernel, *args) for call, args in _arguments(run, inputs)]
    return calls[0] if len(calls) == 1 else partial(call_each, calls)


def _arguments(
    run: RunCalls, inputs: list[torch.Tensor]
) -> list[tuple[KernelCall, list[torch.Tensor | int | float]]]:
    buffers = [
        torch.empty_strided(buffer.size, buffer.stride, dtype=DTYPES[buffer.dtype])
        for buffer in run.buffers
    ]
    return [
        (call, [_value(source, inputs, buffers) for source in call.arguments]) for call in run.calls
    ]


def _value(
    source: Source, inputs: list[torch.Tensor], buffers: list[torch.Tensor]
) -> torch.Tensor | int | float:
    """What ``source`` names. (A function of its own, not a closure: one that called
    itself would be a reference cycle holding the buffers until the cycle collector.)"""
    kind = source[0]
    if kind == "input":
        return inputs[source[1]]
    if kind == "buffer":
        return buffers[source[1]]
    if kind == "view":
        return _view(_value(source[1], inputs, buffers), source[2], source[3], source[4])
    return source[1]


def _view(base: torch.Tensor, size: list[int], stride: list[int], offset: int) -> torch.Tensor:
    """Inductor's ``reinterpret_tensor``: its offset counts from ``base``'s own."""
    return base.as_strided(size, stride, base.storage_offset() + offset)


def _allocate_and_call(run: RunCalls, inputs: list[torch.Tensor]) -> None:
    for call, args in _arguments(run, inputs):
        call.kernel(*args)


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


def call_each(calls: list[Callable[[], Any]]) -> None:
    for call in calls:
        call()
