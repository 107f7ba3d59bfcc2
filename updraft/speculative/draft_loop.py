"""A head's greedy draft loop as one captured graph per batch size.

A draft head is one decoder layer: a step of it is cheap, and replaying k - 1 of them
one by one, each with its step built on the host and its argmax read back, costs more
in host time than the head computes. Where every drafting request is greedy, the loop
is one graph instead: draft step d (1..k-1) takes draft d - 1 (the argmax of the last
step's logits, inside the graph), writes the head's entry at position n - 2 + d, and
chains the head's own hidden state, exactly as ``draft_token_by_token`` steps do.

Its declared inputs (``DRAFT_LOOP_INPUTS``) are what every step derives from: each
request's first draft, the position of its first entry, its block table, the head's
state at its newest entry, and how many drafts it may carry. Each step's positions,
slots and context lengths are computed inside the graph from them, so no step of the
loop has a buffer of its own to go stale. A step past a request's limit (and every step
of a padded row) writes the spare slot and attends to nothing: the scheduler reserved
KV slots only up to the limit.

Attention is captured whole over the bucket's shapes (``AttentionMetadata.bucket``, as
in FULL graphs): a loop has no host-side parameter left to resolve per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from updraft.attention.metadata import AttentionMetadata
from updraft.graph.static_input import LAST
from updraft.graph.updatable import UpdatableGraph
from updraft.runner.captured import graph_backend, input_buffers, static_inputs
from updraft.step.inputs import GraphInput, graph_input_shape, sizes_for

DRAFT_LOOP_INPUTS = (
    GraphInput("input_ids", ("requests",), pad=0),  # the first draft
    GraphInput("positions", ("requests",), pad=0),  # of the second draft's entry: n - 1
    GraphInput("block_table", ("requests", "blocks"), pad=0),
    GraphInput("query_start_loc", ("requests+1",), pad=LAST),
    GraphInput("draft_limits", ("requests",), pad=0),  # padded rows draft nothing
    GraphInput("hidden_states", ("requests", "hidden"), pad=0.0, dtype=None),
)


@dataclass(frozen=True)
class DraftLoopInputs:
    """One request per row (``DRAFT_LOOP_INPUTS``), host or device tensors."""

    input_ids: torch.Tensor  # [requests]
    positions: torch.Tensor  # [requests]
    block_table: torch.Tensor  # [requests, widest block list]
    query_start_loc: torch.Tensor  # [requests + 1]: one query token each
    draft_limits: torch.Tensor  # [requests]
    hidden_states: torch.Tensor  # [requests, hidden]

    @property
    def num_reqs(self) -> int:
        return self.input_ids.numel()


class CapturedDraftLoop:
    def __init__(
        self,
        head: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks_per_request: int,
        sizes: list[int],
        device: torch.device,
        num_drafts: int,
        hidden_size: int,
        compile_runs: bool = False,
    ) -> None:
        self.head = head
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks_per_request
        self.sizes = sorted(set(sizes))
        self.num_drafts = num_drafts
        self.hidden_size = hidden_size
        self.compile_runs = compile_runs
        largest = sizes_for(
            self.sizes[-1], self.sizes[-1], blocks=self.max_blocks, hidden=hidden_size
        )
        dtype = next(head.parameters()).dtype
        self.buffers = input_buffers(DRAFT_LOOP_INPUTS, largest, dtype, device)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[int, tuple[UpdatableGraph, torch.Tensor]] = {}
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first, as a device memory pool wants
                self.graphs[size] = self._capture(size)

    def fits(self, num_reqs: int) -> bool:
        return 0 < num_reqs <= self.sizes[-1]

    def run(self, inputs: DraftLoopInputs) -> torch.Tensor:
        """Every request's ``num_drafts`` greedy drafts [requests, num_drafts], the first
        being its ``input_ids``; drafts past a request's limit are not drafts."""
        size = next(size for size in self.sizes if size >= inputs.num_reqs)
        graph, drafts = self.graphs[size]
        graph.replay(inputs)
        return drafts[: inputs.num_reqs].clone()

    def _capture(self, size: int) -> tuple[UpdatableGraph, torch.Tensor]:
        shape = sizes_for(size, size, blocks=self.max_blocks, hidden=self.hidden_size)
        inputs = static_inputs(DRAFT_LOOP_INPUTS, self.buffers, shape)
        buffers = {name: static_input.buffer for name, static_input in inputs.items()}
        backend = graph_backend(
            self.head, self.kv_caches, inputs.values(), self.pool, self.compile_runs
        )
        graph = UpdatableGraph(backend, list(inputs.values()), metadata=lambda inputs: None)
        # No request at all: the refresh pads every row (padded rows write nothing).
        nothing = sizes_for(0, 0, blocks=self.max_blocks, hidden=self.hidden_size)
        dtype = self.buffers["hidden_states"].dtype
        empty = DraftLoopInputs(
            **{
                spec.name: torch.zeros(graph_input_shape(spec, nothing), dtype=spec.dtype or dtype)
                for spec in DRAFT_LOOP_INPUTS
            }
        )
        return graph, graph.capture(lambda: self._loop(size, **buffers), empty)

    def _loop(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        draft_limits: torch.Tensor,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        block_size = self.block_size
        last_block = block_table.shape[1] - 1
        tokens, state, drafts = input_ids, hidden_states, [input_ids]
        for depth in range(1, self.num_drafts):
            position = positions + (depth - 1)
            live = draft_limits > depth  # this request wants draft ``depth``
            block = block_table.gather(1, (position // block_size).clamp(max=last_block)[:, None])
            slot = block[:, 0] * block_size + position % block_size
            metadata = AttentionMetadata.bucket(
                block_size,
                slot_mapping=torch.where(live, slot, -1),
                block_table=block_table,
                seq_lens=torch.where(live, position + 1, 0),
                query_start_loc=query_start_loc,
                num_requests=size,
                query_len=1,
            )
            state = self.head(tokens, position, self.kv_caches, metadata, hidden_states=state)
            tokens = self.head.compute_logits(state).argmax(dim=-1)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)
