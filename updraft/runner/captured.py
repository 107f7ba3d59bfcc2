"""Captured steps: one ``UpdatableGraph`` per bucket, the only place graphs are made.

A bucket is (requests, query length): decode steps have query length 1, speculative
verify steps 1 + k. A draft head's runner also has a bucket per batch size whose
forward is its whole greedy draft loop (``draft_loop.py``). All buckets of one kind
share one set of static input buffers, made from its declared inputs (``GRAPH_INPUTS``
or a head's ``HEAD_GRAPH_INPUTS``; ``DRAFT_LOOP_INPUTS``) at the largest shape; a
bucket reads their leading rows. A step of ``n`` requests that all have query length
``q`` replays the smallest captured bucket ``(b >= n, q)``, its inputs padded by each
buffer's refresh; any other step runs eagerly. On the CPU, ``compile_runs`` fuses each
graph's runs of ops with inductor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
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
from updraft.runner.draft_loop import DRAFT_LOOP_INPUTS, DraftLoop, DraftLoopInputs, greedy_drafts
from updraft.step.inputs import (
    GRAPH_INPUTS,
    ForwardInputs,
    GraphInput,
    empty_inputs,
    graph_input_shape,
    sizes_for,
)

ATTENTION_INPUTS = ("slot_mapping", "block_table", "seq_lens", "query_start_loc")


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
        from each step."""
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
        self.graphs: dict[Bucket, Captured] = {}
        with torch.inference_mode():
            # Most tokens first, as a device memory pool wants.
            for bucket in sorted(buckets, key=attrgetter("num_tokens"), reverse=True):
                self.graphs[bucket] = self._capture(bucket)
        mark_phase(f"{owner}: graphs captured")

    def held_tensors(self) -> list[torch.Tensor]:
        """What the captured steps hold beside the weights and KV caches: their static
        inputs, outputs and (the CPU backend's) arenas, for a memory report."""
        held = list(tensors_in(list(self.buffers.values())))
        for captured in self.graphs.values():
            held += tensors_in(captured.outputs)
            arena = getattr(captured.graph.backend, "arena", None)
            held += [] if arena is None else [arena]
        return held

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
        query_lens = step.query_lens
        if not query_lens:
            return None
        if (
            query_lens[0] in self.query_lens
            and step.num_reqs <= self.sizes[-1]
            and all(n == query_lens[0] for n in query_lens)
        ):
            return Bucket(next(size for size in self.sizes if size >= step.num_reqs), query_lens[0])
        return next(
            (
                bucket
                for bucket in self.mixed
                if bucket.tokens >= step.num_tokens and bucket.requests >= step.num_reqs
            ),
            None,
        )

    def loop_bucket_for(self, num_reqs: int) -> Bucket | None:
        if self.draft_loop_depth < 2 or not 0 < num_reqs <= self.sizes[-1]:
            return None
        return Bucket(next(size for size in self.sizes if size >= num_reqs), 1, loop=True)

    def why_not(self, step: ForwardInputs, num_drafts: list[int]) -> str:
        """Why ``bucket_for(step)`` is None, for the runner's step counts."""
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
        captured.graph.replay(inputs)
        if bucket.loop:
            return captured.outputs[: inputs.num_reqs]
        if bucket.mixed:
            return captured.outputs[: inputs.num_tokens], None
        hidden, logits = captured.outputs
        return hidden[: inputs.num_tokens], logits[: inputs.num_tokens]

    def _capture(self, bucket: Bucket) -> Captured:
        """The bucket's graph, captured over a step of nothing (the refresh pads every
        row: padded rows write nothing). Not ``self`` but its parts go into the graph's
        functions, which the graph keeps."""
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
            standard = {spec.name for spec in GRAPH_INPUTS}
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
            **declared, compile_runs=compile_runs, token_rows=token_rows, arenas=pool
        )
    return CudaGraph(**declared, pool=pool)
