"""The nodes a recorded graph keeps: ops with the tensors they ran on, and tasks; and
how a node is bound into a call with no arguments for replay."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch

from updraft.kernels.bound_calls import bound_call


@dataclass
class OpNode:
    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]  # captured results that replay writes into
    rerun: bool
    out_variant: torch._ops.OpOverload | None = None  # writes straight into outputs[0]


@cache  # reading schemas costs more than the lookup: capture asks per op
def find_out_variant(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
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
    key: Hashable  # who registered it (UpdatableGraph: one task per key)
    output: torch.Tensor


def leaves(value: Any) -> Iterator[Any]:
    """What ``value`` holds, through tuples (named ones too), lists and dicts' values:
    the containers an op's arguments and results come in. A plain walk: torch's pytree
    builds a spec of the structure too, about 25 us a node, and capture walks every
    op's arguments a few times."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    else:
        yield value


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    _collect_tensors(value, found)
    return found


def _collect_tensors(value: Any, found: list[torch.Tensor]) -> None:
    # Not ``leaves`` filtered: a generator per container, and a call per leaf, made
    # capture's three walks of every op's arguments about 1.8x slower.
    if isinstance(value, (tuple, list)):
        items: Iterable[Any] = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            _collect_tensors(item, found)


def tensors_hidden_in(value: Any) -> list[str]:
    """The fields of objects in ``value`` (dataclasses, at any depth) that hold tensors
    ``tensors_in`` cannot see: a graph would not know it reads them."""
    hidden = []
    for leaf in leaves(value):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for item in dataclasses.fields(leaf):
                inner = getattr(leaf, item.name)
                if tensors_in(inner) or tensors_hidden_in(inner):
                    hidden.append(f"{type(leaf).__name__}.{item.name}")
    return hidden


def storage_of(tensor: torch.Tensor) -> int:
    if tensor.is_mkldnn:  # an opaque prepacked weight has no storage: it names itself
        return id(tensor)
    return tensor.untyped_storage().data_ptr()


class TokenRows:
    """How many of a captured step's token rows hold tokens at the replay under way: a
    mixed step's graph is captured over ``captured`` rows and replayed over a step of
    ``live`` of them, the rest padding. The graph that owns it sets ``live`` before
    each replay; its row-wise kernels over exactly ``captured`` rows read it."""

    def __init__(self, captured: int) -> None:
        self.captured = self.live = captured


def bind(node: OpNode, token_rows: TokenRows | None = None) -> Callable[[], Any]:
    """One recorded op as a call with no arguments that leaves its result in the
    captured output tensors: one of updraft's kernels as its C call, bound once
    (``kernels/bound_calls.py``), any other op through the dispatcher (``_op`` skips
    the Python wrapper of ``OpOverload``). With ``token_rows``, a kernel whose rows are
    independent and are the step's tokens runs over the live ones only: a padded row's
    output is never read into a live row's (attention skips padded requests), so a
    prefill padded to its bucket pays the matrix products of its own tokens."""
    native = bound_call(node.func, node.args, node.kwargs, node.outputs)
    if native is not None:
        if token_rows is not None and native.rows == token_rows.captured:
            return lambda: native.leading_rows(token_rows.live)
        return native
    if node.out_variant is not None:
        return partial(node.out_variant._op, *node.args, **node.kwargs, out=node.outputs[0])
    run = partial(node.func._op, *node.args, **node.kwargs)
    if not node.outputs:  # an in-place op writes its targets itself
        return run
    outputs = node.outputs

    def run_and_copy() -> None:
        for captured, fresh in zip(outputs, tensors_in(run()), strict=True):
            captured.copy_(fresh)

    return run_and_copy
