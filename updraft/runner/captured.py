"""Captured steps: one ``UpdatableGraph`` per bucket, the only place graphs are made.

A bucket is (requests, query length): decode steps have query length 1, speculative
verify steps 1 + k. A draft head's runner also has a bucket per batch size whose
forward is its whole greedy draft loop (``draft_loop.py``). All buckets of one kind
share one set of static input buffers, made from its declared inputs (``GRAPH_INPUTS``
or a head's ``HEAD_GRAPH_INPUTS``; ``DRAFT_LOOP_INPUTS``) at the largest shape; a
bucket reads their leading rows. A step of ``n`` requests that all have query length
``q`` replays the smallest captured bucket ``(b >= n, q)``, its inputs padded by each
buffer's refresh; any other step runs eagerly. On the CPU, ``compile_runs`` fuses each
graph's runs of ops with inductor. With ``background``, the buckets are captured and
compiled by a ``CaptureWorker`` in a thread while the engine steps, each replayed once
it is ready (``take_ready``, between steps).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import partial
from operator import attrgetter
from typing import Any, NamedTuple

import torch

from updraft.attention.metadata import NO_SPLIT, AttentionMetadata, ContextSplit
from updraft.graph.arena import SharedArena
from updraft.graph.cuda import CudaGraph
from updraft.graph.recorded import RecordedGraph
from updraft.graph.recorded_nodes import tensors_in
from updraft.graph.static_input import StaticInput
from updraft.graph.updatable import UpdatableGraph
from updraft.resident import mark_phase
from updraft.runner.capture_worker import CaptureWorker
from updraft.runner.draft_loop import DRAFT_LOOP_INPUTS, DraftLoop, DraftLoopInputs, greedy_drafts
from updraft.step.inputs import (
    GRAPH_INPUTS,
    WINDOW_INPUT_NAMES,
    ForwardInputs,
    GraphInput,
    empty_inputs,
    graph_input_shape,
    sizes_for,
)

# The inputs attention metadata is bound over (the windowed pool's, where declared).
ATTENTION_INPUTS = (
    "slot_mapping",
    "block_table",
    "seq_lens",
    "query_start_loc",
    *sorted(WINDOW_INPUT_NAMES),
)

logger = logging.getLogger(__name__)


class Bucket(NamedTuple):
    """``requests`` requests of ``query_len`` tokens each; with ``loop``, the greedy
    draft loop over ``requests`` requests; with ``tokens`` (and query length 0), a mixed
    step: up to ``requests`` requests of any query lengths, ``tokens`` tokens in all."""

    requests: int
    query_len: int
    loop: bool = False
    tokens: int = 0

    @property
    def mixed(self) -> bool:
        return self.tokens > 0

    @property
    def num_tokens(self) -> int:
        return self.tokens if self.mixed else self.requests * self.query_len

    @property
    def shape(self) -> dict[str, int]:
        """As ``AttentionMetadata.bucket`` takes it."""
        return {"num_requests": self.requests, "query_len": self.query_len}


@dataclass(frozen=True)
class Captured:
    graph: UpdatableGraph
    outputs: Any  # what the captured forward returned: views refreshed by each replay
    inputs: dict[str, StaticInput]


class CapturedSteps:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        positions_per_block: int,
        max_blocks_per_request: int,
        sizes: list[int],
        device: torch.device,
        dtype: torch.dtype,
        query_lens: tuple[int, ...] = (1,),
        inputs: tuple[GraphInput, ...] = GRAPH_INPUTS,
        compile_runs: bool = False,
        full: frozenset[int] = frozenset(),
        sizes_of_dims: dict[str, int] | None = None,
        context: ContextSplit = NO_SPLIT,
        owner: str = "target",
        draft_loop_depth: int = 0,
        draft_loop: DraftLoop = greedy_drafts,
        mixed_tokens: tuple[int, ...] = (),
        background: bool = False,
    ) -> None:
        """``full``: the query lengths whose graphs capture attention inside them,
        shaped by the bucket (``AttentionMetadata.bucket``), instead of as tasks between
        segments. ``dtype``: the compute dtype, of the float inputs (a head's hidden
        states), whatever the weights are kept in. ``sizes_of_dims``: the sizes of dims
        beyond tokens, requests and blocks that ``inputs`` name (``hidden``); inputs
        beyond ``GRAPH_INPUTS`` reach the model as keyword arguments. ``owner``: which
        runner's graphs these are, in the names of their static inputs.
        ``draft_loop_depth`` > 1: also capture the greedy draft loop of that many drafts,
        one bucket per size, run by ``draft_loop``. ``mixed_tokens``: the token counts of
        mixed steps to capture (prefill chunks, alone or beside decodes), each of up to as
        many requests as the largest size; their attention is always a task, made fresh
        from each step. ``background``: capture and compile in a thread (CPU only),
        replaying each bucket from the first step after it is ready."""
        self.model, self.kv_caches = model, kv_caches
        self.positions_per_block, self.context = positions_per_block, context
        self.max_blocks = max_blocks_per_request
        self.sizes = sorted(set(sizes))
        self.query_lens = tuple(sorted(set(query_lens)))
        self.full, self.specs, self.compile_runs = full, inputs, compile_runs
        self.other_sizes = sizes_of_dims or {}
        self.owner, self.draft_loop_depth = owner, draft_loop_depth
        self.draft_loop = draft_loop
        buckets = [Bucket(size, q) for q in self.query_lens for size in self.sizes]
        self.mixed = [
            Bucket(min(self.sizes[-1], tokens), 0, tokens=tokens)
            for tokens in sorted(set(mixed_tokens))
        ]
        buckets += self.mixed
        if draft_loop_depth > 1:
            buckets += [Bucket(size, 1, loop=True) for size in self.sizes]
        self.buffers = {
            loop: input_buffers(self._specs(loop), self._largest(buckets, loop), dtype, device)
            for loop in {bucket.loop for bucket in buckets}
        }
        # CUDA buckets share one memory pool; the CPU's recorded ones one arena (only
        # one step runs at a time).
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else SharedArena()
        self._make_graphs(buckets, background)

    def _make_graphs(self, buckets: list[Bucket], background: bool) -> None:
        """Every bucket's graph now, or a worker that makes them in the background."""
        self.graphs: dict[Bucket, Captured] = {}  # the buckets ready to replay
        # Held by a capture in the background, which writes the shared input buffers.
        self.lock = threading.Lock()
        self.worker: CaptureWorker | None = None
        self.num_compiled = 0
        compile_runs = self.compile_runs
        if background and isinstance(self.pool, SharedArena):
            # The buckets most steps replay first: batch-1 decode, then larger ones.
            order = sorted(buckets, key=lambda bucket: (bucket.mixed, bucket.num_tokens))
            capture = partial(self._capture, defer_compile=True)
            self.worker = CaptureWorker(capture, order, compile_runs, self.lock, self.owner)
            return
        with torch.inference_mode():
            # Most tokens first, as a device memory pool wants.
            for bucket in sorted(buckets, key=attrgetter("num_tokens"), reverse=True):
                self.graphs[bucket] = self._capture(bucket)
        mark_phase(f"{self.owner}: graphs captured")

    def held_tensors(self) -> list[torch.Tensor]:
        """What the captured steps hold beside the weights and KV caches: their static
        inputs, outputs and (the CPU backend's) arenas, for a memory report."""
        held = list(tensors_in(list(self.buffers.values())))
        for captured in self.graphs.values():
            held += tensors_in(captured.outputs)
            arena = getattr(captured.graph.backend, "arena", None)
            held += [] if arena is None else [arena]
        return held

    def take_ready(self) -> None:
        """Between steps: the buckets the background worker has captured or compiled
        since the last step start being replayed (each compiled one is checked, by
        running its new runs, before its first replay). Raises what stopped the worker.
        Left for the next step while the worker holds the lock (capturing)."""
        if self.worker is None or self.worker.finished or not self.lock.acquire(blocking=False):
            return
        try:
            with torch.inference_mode():  # a compiled run's check writes its results
                for handed in self.worker.take():
                    self._put_in(*handed)
        finally:
            self.lock.release()

    def _put_in(self, kind: str, bucket: Bucket | None, value: Any) -> None:
        if kind == "captured":
            self.graphs[bucket] = value
        elif kind == "compiled":
            self.graphs[bucket].graph.backend.swap(value)
            self.num_compiled += 1
            logger.info(
                "%s: bucket %s compiled, swapped in (%d of %d)",
                self.owner,
                describe(bucket),
                self.num_compiled,
                len(self.worker.buckets),
            )
        elif kind == "failed":
            self.worker.finished = True
            raise value
        else:
            self.worker.finished = True
            logger.info("%s: every graph bucket ready, %.1f s after the start", self.owner, value)

    def ready(self, wait: bool = False) -> bool:
        """Whether every bucket is captured (and compiled) and in use (``take_ready``);
        ``wait``: until the worker is done."""
        if self.worker is not None and wait:
            self.worker.thread.join()
        self.take_ready()
        return self.worker is None or self.worker.finished

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def _specs(self, loop: bool) -> tuple[GraphInput, ...]:
        return DRAFT_LOOP_INPUTS if loop else self.specs

    def _sizes(self, bucket: Bucket) -> dict[str, int]:
        return sizes_for(
            bucket.num_tokens, bucket.requests, blocks=self.max_blocks, **self.other_sizes
        )

    def _largest(self, buckets: list[Bucket], loop: bool) -> dict[str, int]:
        """The sizes of the buffers the buckets of a kind share: each of its dims at the
        most any of them reads."""
        kind = [bucket for bucket in buckets if bucket.loop == loop]
        return sizes_for(
            max(bucket.num_tokens for bucket in kind),
            max(bucket.requests for bucket in kind),
            blocks=self.max_blocks,
            **self.other_sizes,
        )

    def bucket_for(self, step: ForwardInputs) -> Bucket | None:
        """The smallest ready bucket that holds ``step``, if any."""
        self.take_ready()
        if self.worker is not None and self.lock.locked():
            return None
        return next((bucket for bucket in self._fitting(step) if bucket in self.graphs), None)

    def _fitting(self, step: ForwardInputs) -> list[Bucket]:
        """The buckets that could hold ``step``, smallest first (ready or not)."""
        query_lens = step.query_lens
        if not query_lens:
            return []
        uniform = []
        if query_lens[0] in self.query_lens and all(n == query_lens[0] for n in query_lens):
            uniform = [Bucket(size, query_lens[0]) for size in self.sizes if size >= step.num_reqs]
        return uniform + [
            bucket
            for bucket in self.mixed
            if bucket.tokens >= step.num_tokens and bucket.requests >= step.num_reqs
        ]

    def loop_bucket_for(self, num_reqs: int) -> Bucket | None:
        if self.draft_loop_depth < 2 or not 0 < num_reqs <= self.sizes[-1]:
            return None
        self.take_ready()  # once ready, always: ``fits_draft_loop`` and then ``draft_loop``
        sizes = [size for size in self.sizes if size >= num_reqs]
        return next((b for size in sizes if (b := Bucket(size, 1, loop=True)) in self.graphs), None)

    def why_not(self, step: ForwardInputs, num_drafts: list[int]) -> str:
        """Why ``bucket_for(step)`` is None, for the runner's step counts."""
        if self.worker is not None and self._fitting(step):
            return "graph not captured yet"
        if step.num_reqs > self.sizes[-1]:
            return "batch above the largest capture size"
        if not any(num_drafts) and step.num_decodes < step.num_reqs:
            return "prefill" if not self.mixed else "prefill above the largest captured tokens"
        if any(n != step.query_lens[0] for n in step.query_lens):
            return "mixed query lengths"
        return f"query length {step.query_lens[0]} not captured"

    def run(self, inputs: ForwardInputs | DraftLoopInputs, bucket: Bucket) -> Any:
        """What the bucket's forward returns, by replay from ``inputs``: views of the
        graph's outputs, valid until the next replay. A step's are (hidden states,
        logits) of its tokens, a mixed step's (hidden states, None): only the rows that
        sample need logits; a loop's its drafts [requests, depth]."""
        captured = self.graphs[bucket]
        with self.lock:
            captured.graph.replay(inputs)
        if bucket.loop:
            return captured.outputs[: inputs.num_reqs]
        if bucket.mixed:
            return captured.outputs[: inputs.num_tokens], None
        hidden, logits = captured.outputs
        return hidden[: inputs.num_tokens], logits[: inputs.num_tokens]

    def _capture(self, bucket: Bucket, defer_compile: bool = False) -> Captured:
        """The bucket's graph, captured over a step of nothing (the refresh pads every
        row: padded rows write nothing). Not ``self`` but its parts go into the graph's
        functions, which the graph keeps. ``defer_compile``: its runs replay op by op
        until compiled (``RecordedGraph.compile``)."""
        specs = self._specs(bucket.loop)
        sizes = self._sizes(bucket)
        name = f"{self.owner} draft loop" if bucket.loop else self.owner
        inputs = static_inputs(specs, self.buffers[bucket.loop], sizes, name)
        tensors = {name: static_input.buffer for name, static_input in inputs.items()}
        model, kv_caches, context = self.model, self.kv_caches, self.context
        positions_per_block, depth = self.positions_per_block, self.draft_loop_depth
        draft_loop = self.draft_loop
        empty = empty_inputs(specs, DraftLoopInputs if bucket.loop else ForwardInputs, sizes)
        attention = {name: tensors[name] for name in ATTENTION_INPUTS if name in tensors}

        def metadata(step: ForwardInputs) -> AttentionMetadata:
            """The step's shapes over the bucket's buffers."""
            return AttentionMetadata.bind(
                step, positions_per_block, **attention, num_tokens=sizes["tokens"], context=context
            )

        def task_kwargs(step: ForwardInputs) -> dict[str, AttentionMetadata]:
            """What the attention tasks take fresh at each replay: the step's metadata
            (a loop holds its attention whole: none)."""
            return {} if bucket.loop else {"metadata": metadata(step)}

        if bucket.loop:
            loop = DraftLoopInputs(**tensors)

            def forward() -> torch.Tensor:
                return draft_loop(model, kv_caches, loop, depth, positions_per_block, context)

        else:
            if not bucket.mixed and bucket.query_len in self.full:  # attention bucket-shaped
                shapes = AttentionMetadata.bucket(
                    positions_per_block, **attention, **bucket.shape, context=context
                )
            else:  # the capture step's shapes, which every replay makes fresh
                shapes = metadata(empty)
                if not bucket.mixed:  # what layers without tasks read: the bucket's
                    shapes = replace(shapes, query_len=bucket.query_len)
            standard = {spec.name for spec in GRAPH_INPUTS} | WINDOW_INPUT_NAMES
            extra = {name: tensor for name, tensor in tensors.items() if name not in standard}

            def forward() -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
                hidden = model(
                    tensors["input_ids"], tensors["positions"], kv_caches, shapes, **extra
                )
                return hidden if bucket.mixed else (hidden, model.compute_logits(hidden))

        backend = graph_backend(
            model,
            kv_caches,
            inputs.values(),
            self.pool,
            self.compile_runs,
            token_rows=sizes["tokens"] if bucket.mixed else None,
            defer_compile=defer_compile,
        )
        live_rows = attrgetter("num_tokens") if bucket.mixed else None
        graph = UpdatableGraph(backend, list(inputs.values()), task_kwargs, live_rows)
        return Captured(graph, graph.capture(forward, empty), inputs)


def input_buffers(
    specs: tuple[GraphInput, ...], sizes: dict[str, int], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """One persistent buffer per declared input, at the largest bucket's ``sizes``."""
    return {
        spec.name: torch.zeros(
            graph_input_shape(spec, sizes), dtype=spec.dtype or dtype, device=device
        )
        for spec in specs
    }


def static_inputs(
    specs: tuple[GraphInput, ...],
    buffers: dict[str, torch.Tensor],
    sizes: dict[str, int],
    graph: str,
) -> dict[str, StaticInput]:
    """A bucket's static inputs: the leading part of each shared buffer, at ``sizes``,
    filled from the field of the input's name."""
    return {
        spec.name: StaticInput(
            spec.name,
            buffers[spec.name][tuple(slice(0, n) for n in graph_input_shape(spec, sizes))],
            attrgetter(spec.name),
            spec.pad,
            graph=graph,
        )
        for spec in specs
    }


def graph_backend(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    inputs: Iterable[StaticInput],
    pool: object | None,
    compile_runs: bool,
    token_rows: int | None = None,
    defer_compile: bool = False,
) -> RecordedGraph | CudaGraph:
    """The backend that captures ``model``'s forward over ``inputs``: CUDA graphs in
    ``pool`` on a GPU, else recorded ops (with runs compiled by inductor; a mixed step's,
    over ``token_rows`` rows, runs its row-wise kernels over each step's own)."""
    declared = dict(
        constants=[*model.parameters(), *model.buffers()],
        persistent=[*kv_caches, *(i.buffer for i in inputs)],
        module_names={id(m): name or "model" for name, m in model.named_modules()},
    )
    if pool is None or isinstance(pool, SharedArena):
        return RecordedGraph(
            **declared,
            compile_runs=compile_runs,
            token_rows=token_rows,
            defer_compile=defer_compile,
            arenas=pool,
        )
    return CudaGraph(**declared, pool=pool)


def describe(bucket: Bucket) -> str:
    """A bucket as a progress line names it."""
    if bucket.loop:
        return f"draft loop x{bucket.requests}"
    if bucket.mixed:
        return f"mixed {bucket.tokens} tokens"
    return f"{bucket.requests} x {bucket.query_len}"
