"""Compiled runs: the recorded CPU graph's ops fused into kernels by inductor.

Replaying recorded ops one by one costs one dispatcher call and one pass over memory
per op: a decode layer's norms, rotary embedding, activation and residual adds are a
few dozen small ops, which on a small model cost more than its matrix products. A
compiled run is one of those stretches turned into an FX graph and compiled by inductor,
so it runs as a few fused loops.

A run is a maximal stretch of recorded ops between two things a run cannot hold:

* a task (its host-side parameters change per step: it stays a Python call);
* an op that writes its inputs in place (the KV cache write): inductor would make it a
  functional copy of the whole cache;
* an op on an opaque oneDNN weight (it has no storage a compiled graph can describe);
* one of updraft's kernels, which replays as a bound C call (``kernels/bound_calls.py``)
  or as recorded: inductor would call it through the dispatcher, from a wrapper that
  then does more than call C++ kernels, so the run could be neither bound
  (``frozen_calls.py``) nor kept for a later start (``run_store.py``).

The graph's inputs are the very tensors the recorded ops read (weights, the KV cache,
static input buffers, earlier results), so a replay reads whatever was refreshed into
them; views taken inside the run are re-taken inside the graph. Each result that anything
after the run reads (a later op, a task, the graph's output) is copied into the tensor
captured for it, so everything downstream finds it where it did at capture.

Decoder layers repeat the same runs over other weights: a process-wide cache keyed by
the graph's code and its inputs' shapes compiles each distinct run once, and inductor's
own cache on disk (``compile_cache.py``) makes a later start quick.

Compiling only reads the tensors' shapes, so it may run in a thread beside the steps
(``runner/capture_worker.py``): ``compiled_segments(..., finish=False)`` leaves each
compiled run pending, and ``finished`` (between steps, in the thread that replays) makes
it callable, running it once for the check of its direct call.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_map

from updraft.graph import frozen_calls, run_store
from updraft.graph.compile_cache import open_cache
from updraft.graph.intermediates import TRIM_EVERY_BYTES
from updraft.graph.recorded_nodes import (
    OpNode,
    TaskNode,
    TokenRows,
    bind,
    storage_of,
    tensors_in,
)
from updraft.kernels.bound_calls import has_bound_call
from updraft.resident import give_back_free_memory

logger = logging.getLogger(__name__)

# Fewer ops than this run as they were recorded: a compiled call costs about as much as
# one op, so fusing a single op gains nothing.
MIN_OPS_PER_RUN = 2
# The namespace of updraft's own ops (``torch.ops.updraft``): kept out of runs.
UPDRAFT_OPS = "updraft"

# Ops inductor calls through the dispatcher from its wrapper on the CPU (an extern
# kernel: BLAS, a sort, a scan, a scatter) rather than compiling them into its kernels:
# kept out of runs too, they replay as recorded, and every run is kernel calls alone,
# which a later start loads without inductor (``frozen_calls``). A mixture's router made
# every start of a MoE model import and run inductor (+116 MiB) for its sort, top-k,
# matmul and scatter.
EXTERN_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "sort", "argsort", "topk", "cumsum"}
    | {"scatter_add", "scatter_reduce", "index_add"}
)

_compiled: dict[tuple[Any, ...], Compiled | None] = {}
# Inductor is not made to compile in two threads at once (each runner's worker compiles).
_compile_lock = threading.Lock()
# A compiled graph whose direct call has not been checked yet (``finished`` checks it).
UNCHECKED = object()


def compilable(node: OpNode) -> bool:
    func = node.func
    if func._schema.is_mutable or has_bound_call(func) or func.namespace == UPDRAFT_OPS:
        return False
    if func.namespace == "aten" and func.overloadpacket.__name__ in EXTERN_OPS:
        return False
    return not any(tensor.is_mkldnn for tensor in tensors_in((node.args, node.kwargs)))


def replay_calls(nodes: Sequence[OpNode | TaskNode]) -> list[list[int]]:
    """The recorded nodes' indices as the calls a compiled replay makes: each run of
    compilable ops one call, every other node (a task, a bound op) one of its own."""
    calls: list[list[int]] = []
    run: list[int] = []
    for index, node in enumerate(nodes):
        if isinstance(node, OpNode) and compilable(node):
            run.append(index)
            continue
        if run:
            calls.append(run)
            run = []
        calls.append([index])
    if run:
        calls.append(run)
    return calls


class PendingRun(NamedTuple):
    """A compiled run not yet callable: ``finished`` checks its graph's direct call (which
    runs it, so only where no replay runs beside it) and binds it to its tensors."""

    key: tuple[Any, ...]  # of its graph in ``_compiled``
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    nodes: list[OpNode]  # replayed one by one where a kept run fails its check


def compiled_segments(
    nodes: Sequence[OpNode | TaskNode],
    output_storages: set[int],
    token_rows: TokenRows | None = None,
    finish: bool = True,
) -> list[list[Any]]:
    """The replay segments of a recorded graph (segment i runs before task i), with each
    run of compilable ops as one compiled call and every other op bound as recorded
    (``bind``, with ``token_rows``). Without ``finish``, compiled runs are left as
    ``PendingRun``s, for ``finished`` to complete in the thread that replays."""
    last_read = _last_reads(nodes, output_storages)
    segments: list[list[Callable[[], Any]]] = [[]]
    for call in replay_calls(nodes):
        first = nodes[call[0]]
        if isinstance(first, TaskNode):
            segments.append([])
        elif len(call) > 1 or compilable(first):
            run = [nodes[index] for index in call]
            if sum(node.rerun for node in run) >= MIN_OPS_PER_RUN:
                segments[-1].append(_compiled_run(run, last_read, call[-1] + 1))
            else:
                segments[-1].extend(_bound(node) for node in run if node.rerun)
        elif first.rerun:
            segments[-1].append(_bound(first, token_rows))
    return finished(segments) if finish else segments


def _bound(node: OpNode, token_rows: TokenRows | None = None) -> Callable[[], Any]:
    call = bind(node, token_rows)
    indices = any(not t.is_floating_point() for t in tensors_in(node.outputs))
    return IndexCall(call) if indices else call


def finished(segments: list[list[Any]]) -> list[list[Callable[[], Any]]]:
    """``segments`` with each pending run made callable, and each run and ``IndexCall``
    made once, in order (why: ``IndexCall``). Checking a run makes and drops its buffers
    and copies of its targets; glibc's heap seldom fits the next run's of another size
    into what they left, so its free pages go back to the system every
    ``TRIM_EVERY_BYTES`` (a 500M model's largest mixed bucket: +140 MiB without)."""
    made = 0
    calls = []
    for segment in segments:
        calls.append([])
        for call in segment:
            if isinstance(call, PendingRun):
                made += _checked_bytes(call)
                call = _finish(call)
                if made >= TRIM_EVERY_BYTES:
                    give_back_free_memory()
                    made = 0
                call()
            elif isinstance(call, IndexCall):
                call = call.call
                call()
            calls[-1].append(call)
    return calls


class IndexCall(NamedTuple):
    """An op outside the runs whose results are integers (an order, top-k ids, offsets).

    Finishing makes each run and each of these once, in order, so that a run's check
    reads the indices the calls before it computed, never what memory held: a run whose
    code was checked at another layer is not run by a check, nor is an op replayed as
    recorded, and an index out of range aborts the process inside inductor's kernel (a
    mixture's order of expert rows did). The matrix products, whose results are floats,
    are not made: a bucket of 2048 tokens would pay a whole forward at its swap. Calls
    never write what they read, and finishing happens between replays, so one more call
    changes nothing else."""

    call: Callable[[], Any]

    def __call__(self) -> None:
        self.call()


def _checked_bytes(run: PendingRun) -> int:
    """About what checking ``run`` allocates: its buffers, twice, and its targets."""
    entry = _compiled[run.key]
    buffers = 0 if entry.calls is None else 2 * entry.calls.kept_bytes()
    return buffers + sum(target.untyped_storage().nbytes() for target in run.targets)


def _finish(run: PendingRun) -> Callable[[], Any]:
    entry = _compiled[run.key]
    if entry.direct is UNCHECKED:
        direct = _direct_call(entry.wrapped, run.inputs, run.targets)
        entry = _compiled[run.key] = entry._replace(direct=direct)
    if entry.calls is not None:
        bound = _bound_calls(entry, run)
        if bound is not None:
            return bound
        entry = _compiled[run.key]
    if entry.wrapped is None:  # kept, and failed its check: nothing compiled to fall back on
        return _op_by_op(run.nodes)
    if entry.direct is None:
        return partial(entry.wrapped, *run.inputs)
    direct, inputs = entry.direct, run.inputs

    def run_direct() -> None:
        direct(inputs.copy())  # inductor's call empties the list it is given

    return run_direct


def _bound_calls(entry: Compiled, run: PendingRun) -> Callable[[], None] | None:
    """The run's kernel calls bound to its tensors, checked to write back what inductor's
    own call writes (or, for a run kept from an earlier start, what they wrote
    themselves), else None and the kept file removed."""
    bound = frozen_calls.bind(entry.calls, run.inputs)
    reference = entry.direct if callable(entry.direct) else None
    try:
        if reference is not None:
            reference(list(run.inputs))
        elif entry.wrapped is not None:
            entry.wrapped(*run.inputs)
        else:
            bound()
        if rewrites(bound, run.targets):
            return bound
        why = "missed a target"
    except RuntimeError as error:  # a kept call of the wrong arity, say
        why = str(error)
    logger.warning("a compiled run's bound kernels failed their check (%s); not kept", why)
    folder = open_cache()
    if folder is not None:
        run_store.forget(folder, run_store.run_name(*run.key))
    _compiled[run.key] = entry._replace(calls=None)
    if entry.wrapped is not None:
        entry.wrapped(*run.inputs)  # the targets as inductor's call writes them
    return None


def _op_by_op(nodes: list[OpNode]) -> Callable[[], None]:
    """A run's ops replayed as they were recorded."""
    return partial(frozen_calls.call_each, [bind(node) for node in nodes if node.rerun])


def _last_reads(nodes: Sequence[OpNode | TaskNode], output_storages: set[int]) -> dict[int, float]:
    """Each storage the graph reads (``_storage_object``), with the index of the last
    node that reads it (infinity for what the graph returns)."""
    last: dict[int, float] = {}
    returned = set()
    for index, node in enumerate(nodes):
        read = node.kwargs if isinstance(node, TaskNode) else (node.args, node.kwargs)
        for tensor in tensors_in(read):
            last[_storage_object(tensor)] = index
        made = node.output if isinstance(node, TaskNode) else node.outputs
        returned.update(
            _storage_object(tensor)
            for tensor in tensors_in(made)
            if storage_of(tensor) in output_storages
        )
    last.update((storage, math.inf) for storage in returned)
    return last


def _storage_object(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` is a view of, told apart by the storage object rather
    than its address: the arena places storages whose lives never meet at the same
    bytes, and each as a storage object of its own, shared by every view of it. By
    address, a result would be kept for the readers of whatever is placed over it later."""
    return id(tensor) if tensor.is_mkldnn else tensor.untyped_storage()._cdata


def _compiled_run(run: list[OpNode], last_read: dict[int, float], end: int) -> Any:
    """``run`` as one compiled call; ``end`` is the index of the node after it."""
    graph = torch.fx.Graph()
    values: dict[int, torch.fx.Node] = {}  # id of a captured tensor -> its graph value
    inputs: list[torch.Tensor] = []

    def value_of(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) not in values:
            values[id(leaf)] = graph.placeholder(f"input_{len(inputs)}")
            inputs.append(leaf)
        return values[id(leaf)]

    results: list[tuple[torch.Tensor, torch.fx.Node]] = []
    for node in run:
        call = graph.call_function(
            node.func, tree_map(value_of, node.args), tree_map(value_of, node.kwargs)
        )
        returns = node.func._schema.returns
        if len(returns) == 1 and not isinstance(returns[0].type, torch.ListType):
            outputs = [(node.outputs[0], call)]
        else:
            outputs = [
                (tensor, graph.call_function(operator.getitem, (call, i)))
                for i, tensor in enumerate(node.outputs)
            ]
        for tensor, value in outputs:
            values[id(tensor)] = value
        if node.rerun:
            results.extend(outputs)
    # Views alias a result's storage, so refreshing the result refreshes them too.
    kept: dict[int, tuple[torch.Tensor, torch.fx.Node]] = {}
    for tensor, value in results:
        storage = _storage_object(tensor)
        if last_read.get(storage, -1) >= end and storage not in kept:
            kept[storage] = (tensor, value)
    # The graph writes them into the captured tensors itself: inductor then stores each
    # result straight into its target instead of into a new tensor copied after.
    targets = [tensor for tensor, _ in kept.values()]
    for tensor, value in kept.values():
        target = graph.placeholder(f"target_{len(inputs)}")
        inputs.append(tensor)
        graph.call_function(torch.ops.aten.copy_.default, (target, value))
    graph.output(())
    module = torch.fx.GraphModule({}, graph)
    key = _compile(module, inputs)
    if _compiled[key] is None:
        return _op_by_op(run)
    return PendingRun(key, inputs, targets, run)


class Compiled(NamedTuple):
    """A compiled run as AOTAutograd wraps it (called with the inputs as arguments), and
    inductor's own call inside (called with a list of them) where that does the same;
    and the kernel calls that call makes, where it makes nothing else. A run kept from an
    earlier start (``graph/run_store.py``) has only those."""

    wrapped: Callable[..., Any] | None
    direct: Callable[[list[torch.Tensor]], Any] | object | None  # or UNCHECKED
    calls: frozen_calls.RunCalls | None


def _direct_call(
    wrapped: Callable[..., Any], inputs: list[torch.Tensor], targets: list[torch.Tensor]
) -> Callable[[list[torch.Tensor]], Any] | None:
    """Inductor's compiled call without AOTAutograd's runtime wrapper around it, or None.

    The wrapper costs about 5 microseconds a call, as much as a small run's kernels, and
    a decode step makes about fifty runs. For a run it has nothing to do: the run returns
    nothing, and its only mutations (the copies into its targets) stay inside inductor's
    graph, as they do for any inference graph whose mutated inputs alias no other input.
    Rather than trust that reading of AOTAutograd, each compiled graph is checked once: the
    targets are poisoned, and the direct call must write back, bit for bit, what the
    wrapped call wrote. A run is idempotent (it never writes what it reads), so calling it
    again at capture changes nothing."""
    direct = getattr(wrapped, "current_callable", None)
    if direct is None or not targets:
        return None
    wrapped(*inputs)
    if rewrites(partial(direct, list(inputs)), targets):
        return direct
    logger.warning("a compiled run's direct call missed a target; it keeps the wrapper")
    wrapped(*inputs)
    return None


def rewrites(call: Callable[[], Any], targets: list[torch.Tensor]) -> bool:
    """Whether ``call`` writes back, bit for bit, what ``targets`` hold now (what the run
    wrote): each is poisoned first, every bit of it flipped. Compared as bits, since at
    capture a run may compute NaNs from memory nothing has written yet."""
    bits = [_bits(target) for target in targets]
    expected = [target.clone() for target in bits]
    for target in bits:
        torch.bitwise_not(target, out=target)
    call()
    return all(torch.equal(target, want) for target, want in zip(bits, expected, strict=True))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as integers of its element's width (itself if not float)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if not tensor.is_floating_point():
        return tensor
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(widths[tensor.element_size()])


def _compile(module: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> tuple[Any, ...]:
    """The key in ``_compiled`` of inductor's compiled ``module``, shared by every run
    with the same code over inputs of the same layout; None there (with a warning) where
    inductor cannot compile. Compiling reads the inputs' shapes, never their values."""
    key = (
        module.code,
        tuple((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device) for t in inputs),
    )
    with _compile_lock:
        if key not in _compiled:
            _compiled[key] = _kept(key, len(inputs)) or _compile_fx(module, inputs, key)
    return key


def _kept(key: tuple[Any, ...], inputs: int) -> Compiled | None:
    """The run as an earlier start kept it, loaded without inductor, or None."""
    folder = open_cache()
    calls = None if folder is None else run_store.load(folder, run_store.run_name(*key), inputs)
    return None if calls is None else Compiled(None, None, calls)


def _compile_fx(
    module: torch.fx.GraphModule, inputs: list[torch.Tensor], key: tuple[Any, ...]
) -> Compiled | None:
    import torch._inductor.config
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # A shape environment, even with every shape fixed, is what lets inductor keep
    # the compiled graph in its on-disk cache.
    context = TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    # A run is always called with the very tensors it was compiled for: checking
    # their sizes, strides and alignment at every call could never fail, and costs
    # a few microseconds per input.
    settings: dict[str, Any] = dict(size_asserts=False, alignment_asserts=False)
    if threading.current_thread() is not threading.main_thread():
        # Inductor's C++ compiled in this thread, not in its pool: a process that ends (a
        # one-shot generate) would otherwise wait at exit for every queued compile.
        settings["compile_threads"] = 1
    try:
        with tracing(context), torch._inductor.config.patch(**settings):
            wrapped = compile_fx(module, inputs)
    except Exception as error:  # no compiler, an op inductor lacks: replay op by op
        logger.warning("graph run left uncompiled (%s: %s)", type(error).__name__, error)
        return None
    direct = getattr(wrapped, "current_callable", None)
    calls = None if direct is None else frozen_calls.record(direct, inputs)
    folder = open_cache()
    if calls is not None and folder is not None:
        run_store.save(folder, run_store.run_name(*key), calls)
    return Compiled(wrapped, UNCHECKED, calls)
