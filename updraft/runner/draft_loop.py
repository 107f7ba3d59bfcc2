"""A draft head's greedy draft loop, as one forward a runner captures per batch size.

A draft head is one decoder layer: a step of it is cheap, and running k - 1 of them one
by one, each with its step built on the host and its argmax read back, costs more in
host time than the head computes. Where every drafting request is greedy, the loop is
one captured graph instead: draft step d (1..k-1) takes draft d - 1 (the argmax of the
last step's logits, inside the graph), writes the head's entry at position n - 2 + d,
and chains the head's own hidden state, exactly as ``draft_token_by_token`` steps do.

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
from typing import Protocol

import torch

from updraft.attention.metadata import AttentionMetadata, ContextSplit
from updraft.graph.static_input import LAST
from updraft.step.inputs import GraphInput

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

    @property
    def num_tokens(self) -> int:  # the next token of each request
        return self.num_reqs


class DraftLoop(Protocol):
    """A loop's forward: every request's ``depth`` greedy drafts [requests, depth] over
    a bucket of ``inputs.num_reqs`` (``greedy_drafts``, or a drafter's own)."""

    def __call__(
        self,
        head: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        inputs: DraftLoopInputs,
        depth: int,
        positions_per_block: int,
        context: ContextSplit,
    ) -> torch.Tensor: ...


def greedy_drafts(
    head: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    inputs: DraftLoopInputs,
    depth: int,
    positions_per_block: int,
    context: ContextSplit,
) -> torch.Tensor:
    """Every request's ``depth`` greedy drafts [requests, depth], the first being its
    ``input_ids``: ``depth - 1`` head steps over a bucket of ``inputs.num_reqs``."""
    size = inputs.num_reqs
    block_table = inputs.block_table
    last_block = block_table.shape[1] - 1
    tokens, state, drafts = inputs.input_ids, inputs.hidden_states, [inputs.input_ids]
    for step in range(1, depth):
        position = inputs.positions + (step - 1)
        live = inputs.draft_limits > step  # this request wants draft ``step``
        index = (position // positions_per_block).clamp(max=last_block)[:, None]
        slot = block_table.gather(1, index)[:, 0] * positions_per_block
        metadata = AttentionMetadata.bucket(
            positions_per_block,
            slot_mapping=torch.where(live, slot + position % positions_per_block, -1),
            block_table=block_table,
            seq_lens=torch.where(live, position + 1, 0),
            query_start_loc=inputs.query_start_loc,
            num_requests=size,
            query_len=1,
            context=context,
        )
        state = head(tokens, position, kv_caches, metadata, hidden_states=state)
        tokens = head.compute_logits(state).argmax(dim=-1)
        drafts.append(tokens)
    return torch.stack(drafts, dim=1)
