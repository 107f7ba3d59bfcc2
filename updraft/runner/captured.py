"""Captured steps: one ``UpdatableGraph`` per bucket of uniform batches.

A bucket is (requests, query length): decode steps have query length 1, speculative
verify steps 1 + k. All buckets share one set of static input buffers, made from
``GRAPH_INPUTS`` at the largest shape; a bucket reads their leading rows. A step of
``n`` requests that all have query length ``q`` replays the smallest captured bucket
``(b >= n, q)``, its inputs padded by each buffer's refresh; any other step runs eagerly.
On the CPU, ``compile_runs`` fuses each graph's runs of ops with inductor.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter

import torch

from updraft.attention.metadata import NO_SPLIT, AttentionMetadata, ContextSplit
from updraft.graph.cuda import CudaGraph
from updraft.graph.recorded import RecordedGraph
from updraft.graph.static_input import StaticInput
from updraft.graph.updatable import UpdatableGraph
from updraft.step.inputs import (
    GRAPH_INPUTS,
    GraphInput,
    StepInputs,
    capture_inputs,
    graph_input_shape,
    sizes_for,
)

Bucket = tuple[int, int]  # (requests, query length of each)


class CapturedSteps:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        positions_per_block: int,
        max_blocks_per_request: int,
        sizes: list[int],
        device: torch.device,
        query_lens: tuple[int, ...] = (1,),
        inputs: tuple[GraphInput, ...] = GRAPH_INPUTS,
        compile_runs: bool = False,
        full: bool | frozenset[int] = False,
        sizes_of_dims: dict[str, int] | None = None,
        context: ContextSplit = NO_SPLIT,
    ) -> None:
        """``full``: capture attention inside the graphs (of every bucket, or of those
        whose query length is in the set), shaped by the bucket
        (``AttentionMetadata.bucket``), instead of as tasks between segments.
        ``sizes_of_dims``: the sizes of dims beyond tokens, requests and blocks that
        ``inputs`` name (``hidden``); inputs beyond ``GRAPH_INPUTS`` reach the model as
        keyword arguments."""
        self.model = model
        self.kv_caches = kv_caches
        self.positions_per_block = positions_per_block
        self.context = context
        self.max_blocks = max_blocks_per_request
        self.sizes = sorted(set(sizes))
        self.query_lens = tuple(sorted(set(query_lens)))
        # The query lengths whose graphs hold attention.
        self.full = frozenset(self.query_lens) if full is True else frozenset(full or ())
        self.specs = inputs
        self.compile_runs = compile_runs
        self.other_sizes = sizes_of_dims or {}
        largest = sizes_for(
            self.sizes[-1] * self.query_lens[-1],
            self.sizes[-1],
            blocks=self.max_blocks,
            **self.other_sizes,
        )
        self.buffers = input_buffers(inputs, largest, next(model.parameters()).dtype, device)
        # CUDA buckets share one memory pool; the CPU records ops instead.
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[Bucket, tuple[UpdatableGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        buckets = [(size, q) for q in self.query_lens for size in self.sizes]
        with torch.inference_mode():
            # Most tokens first, as a device memory pool wants.
            for bucket in sorted(buckets, key=lambda b: b[0] * b[1], reverse=True):
                self.graphs[bucket] = self._capture(*bucket)

    def bucket_for(self, step: StepInputs) -> Bucket | None:
        query_lens = step.query_lens
        if (
            not query_lens
            or query_lens[0] not in self.query_lens
            or step.num_reqs > self.sizes[-1]
            or any(n != query_lens[0] for n in query_lens)
        ):
            return None
        return next(size for size in self.sizes if size >= step.num_reqs), query_lens[0]

    def why_not(self, step: StepInputs) -> str:
        """Why ``bucket_for(step)`` is None, for the runner's step counts."""
        if step.num_reqs > self.sizes[-1]:
            return "batch above the largest capture size"
        if not any(step.num_drafts) and step.num_decodes < step.num_reqs:
            return "prefill"
        if any(n != step.query_lens[0] for n in step.query_lens):
            return "mixed query lengths"
        return f"query length {step.query_lens[0]} not captured"

    def run(self, step: StepInputs, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, logits) of every token of the step, by replay: views of the
        graph's outputs, valid until the next replay."""
        graph, (hidden, logits) = self.graphs[bucket]
        graph.replay(step)
        return hidden[: step.num_tokens], logits[: step.num_tokens]

    def _capture(
        self, size: int, query_len: int
    ) -> tuple[UpdatableGraph, tuple[torch.Tensor, torch.Tensor]]:
        num_tokens = size * query_len
        shape = sizes_for(num_tokens, size, blocks=self.max_blocks, **self.other_sizes)
        inputs = static_inputs(self.specs, self.buffers, shape)

        # Not self: the graph keeps this function.
        positions_per_block, context = self.positions_per_block, self.context

        attention_inputs = {
            name: inputs[name].buffer
            for name in ("slot_mapping", "block_table", "seq_lens", "query_start_loc")
        }

        def metadata(step: StepInputs) -> AttentionMetadata:
            return AttentionMetadata.bind(
                step,
                positions_per_block,
                **attention_inputs,
                num_tokens=num_tokens,
                context=context,
            )

        backend = graph_backend(
            self.model, self.kv_caches, inputs.values(), self.pool, self.compile_runs
        )
        graph = UpdatableGraph(backend, list(inputs.values()), metadata)
        dummy = capture_inputs(num_tokens, size, self.max_blocks, self.specs, **self.other_sizes)
        standard = {spec.name for spec in GRAPH_INPUTS}
        extra = {name: i.buffer for name, i in inputs.items() if name not in standard}
        if query_len in self.full:
            dummy_metadata = AttentionMetadata.bucket(
                positions_per_block,
                **attention_inputs,
                num_requests=size,
                query_len=query_len,
                context=context,
            )
        else:
            dummy_metadata = metadata(dummy)  # host-side shapes: worked out before capture

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.model(
                inputs["input_ids"].buffer,
                inputs["positions"].buffer,
                self.kv_caches,
                dummy_metadata,
                **extra,
            )
            return hidden, self.model.compute_logits(hidden)

        return graph, graph.capture(forward, dummy)


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
    specs: tuple[GraphInput, ...], buffers: dict[str, torch.Tensor], sizes: dict[str, int]
) -> dict[str, StaticInput]:
    """A bucket's static inputs: the leading part of each shared buffer, at ``sizes``,
    filled from the step's field of the input's name."""
    return {
        spec.name: StaticInput(
            spec.name,
            buffers[spec.name][tuple(slice(0, n) for n in graph_input_shape(spec, sizes))],
            attrgetter(spec.name),
            spec.pad,
        )
        for spec in specs
    }


def graph_backend(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    inputs: Iterable[StaticInput],
    pool: object | None,
    compile_runs: bool,
) -> RecordedGraph | CudaGraph:
    """The backend that captures ``model``'s forward over ``inputs``: CUDA graphs in
    ``pool`` on a GPU, else recorded ops (with runs compiled by inductor)."""
    declared = dict(
        constants=[*model.parameters(), *model.buffers()],
        persistent=[*kv_caches, *(i.buffer for i in inputs)],
        module_names={id(m): name or "model" for name, m in model.named_modules()},
    )
    if pool is None:
        return RecordedGraph(**declared, compile_runs=compile_runs)
    return CudaGraph(**declared, pool=pool)
