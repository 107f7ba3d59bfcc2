"""``StepInputs``: everything one step needs, built on the host from a step plan.

A step's inputs come in two types, so that the graph contract is a type and not a
convention:

* ``ForwardInputs``: what a forward reads, and so everything a captured graph reads.
  Its fields are exactly the declared graph inputs (``GRAPH_INPUTS``, and the hidden
  states a draft head reads, ``HEAD_GRAPH_INPUTS``); attention metadata is built from it
  alone.
* ``SamplingInputs``: what only the logits selection, sampling and verification read:
  which rows sample, their drafts, their sampling parameters.

``StepInputs.build(plan)`` puts requests with a single new token (decodes) first, so
attention serves them as one group, and computes every index tensor with array
operations, not per-token Python.

The tensors a captured graph reads are declared once, in ``GRAPH_INPUTS``: the field's
name, its shape in symbolic sizes, and its pad value. A graph's buffers, their refresh
at every replay, padding to a bucket and the capture step all derive from that table,
so an input that a new model or proposer needs is one more line there (and its field on
``ForwardInputs``). Every padded row is inert: its slot is -1 (no KV write), its
request attends to nothing.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import pairwise
from typing import Any, NamedTuple

import torch

from updraft.graph.static_input import LAST, padded
from updraft.request import Request
from updraft.step.logits_adjustments import (
    NO_ADJUSTMENTS,
    LogitsAdjustments,
    logits_adjustments,
)
from updraft.step.plan import Draft, StateCopy, StepPlan
from updraft.step.prompt_rows import PromptRows
from updraft.step.sampling_batch import SamplingBatch


@dataclass(frozen=True)
class GraphInput:
    name: str  # a ForwardInputs field
    dims: tuple[str, ...]  # sizes by name: tokens, requests, requests+1, blocks, hidden
    pad: int | float | str  # the value of padded entries, or LAST
    dtype: torch.dtype | None = torch.long  # None: the model's compute dtype


GRAPH_INPUTS = (
    GraphInput("input_ids", ("tokens",), pad=0),
    GraphInput("positions", ("tokens",), pad=0),
    GraphInput("slot_mapping", ("tokens",), pad=-1),  # -1 writes into the cache's spare slot
    GraphInput("block_table", ("requests", "blocks"), pad=0),
    GraphInput("seq_lens", ("requests",), pad=0),
    # Padded requests are empty: their start and end are the last real end.
    GraphInput("query_start_loc", ("requests+1",), pad=LAST),
)
# A draft head's steps also read the target's hidden states beside their tokens
# (models/draft_head.py): one more declared input, refreshed like the rest.
HEAD_GRAPH_INPUTS = (
    *GRAPH_INPUTS,
    GraphInput("hidden_states", ("tokens", "hidden"), pad=0.0, dtype=None),
)
# A LongRoPE model's steps also say which row of its rotary table each token reads
# (``RotarySwitch``).
ROTARY_GRAPH_INPUTS = (*GRAPH_INPUTS, GraphInput("rotary_rows", ("tokens",), pad=0))
# A model with linear-attention layers (Qwen3.5) also reads each request's
# recurrent-state slot; -1, the state cache's spare slot, takes padded requests' writes.
# Which row of the slot a step reads and writes is derived from the positions
# (``models/delta_rule.py``), so the slot is the only state input.
STATE_GRAPH_INPUTS = (*GRAPH_INPUTS, GraphInput("state_slots", ("requests",), pad=-1))
# A model whose windowed layers keep their blocks in a pool of their own
# (``engine/window_blocks.py``) also reads those blocks' slots and table: the same
# positions and table columns as the full layers', other block ids. They reach the
# attention metadata, not the model (``WINDOW_INPUT_NAMES``).
WINDOW_GRAPH_INPUTS = (
    *GRAPH_INPUTS,
    GraphInput("window_slot_mapping", ("tokens",), pad=-1),
    GraphInput("window_block_table", ("requests", "blocks"), pad=0),
)
WINDOW_INPUT_NAMES = frozenset(spec.name for spec in WINDOW_GRAPH_INPUTS[len(GRAPH_INPUTS) :])
# Every input any runner may declare: ForwardInputs' fields.
ALL_GRAPH_INPUTS = (
    *HEAD_GRAPH_INPUTS,
    *ROTARY_GRAPH_INPUTS[len(GRAPH_INPUTS) :],
    *STATE_GRAPH_INPUTS[len(GRAPH_INPUTS) :],
    *WINDOW_GRAPH_INPUTS[len(GRAPH_INPUTS) :],
)


def graph_inputs(
    *, head: bool = False, rotary: bool = False, state: bool = False, window: bool = False
) -> tuple[GraphInput, ...]:
    """The inputs a runner declares: the standard ones, and a draft head's hidden
    states, a LongRoPE model's rotary rows, a hybrid model's state slots, the windowed
    pool's slots and block table."""
    extra = ()
    for wanted, specs in (
        (head, HEAD_GRAPH_INPUTS),
        (rotary, ROTARY_GRAPH_INPUTS),
        (state, STATE_GRAPH_INPUTS),
        (window, WINDOW_GRAPH_INPUTS),
    ):
        if wanted:
            extra += specs[len(GRAPH_INPUTS) :]
    return (*GRAPH_INPUTS, *extra)


def model_inputs(specs: tuple[GraphInput, ...]) -> tuple[GraphInput, ...]:
    """The declared inputs beyond the standard ones that reach the model as keyword
    arguments (the windowed pool's go to the attention metadata instead)."""
    return tuple(spec for spec in specs[len(GRAPH_INPUTS) :] if spec.name not in WINDOW_INPUT_NAMES)


class RotarySwitch(NamedTuple):
    """LongRoPE's choice between its short and long frequencies, as transformers makes
    it: a sequence of at most ``original`` tokens uses the short ones; a longer one the
    long ones at every position, its KV recomputed when it grows past ``original``
    (``Scheduler``: ``long_context_from``). Long rows of the rotary table start at
    ``long_offset``."""

    original: int
    long_offset: int

    def is_long(self, request: Request) -> bool:
        return request.num_tokens > self.original

    def cache_salt(self, request: Request) -> bytes:
        """What keeps a long sequence's KV apart in the prefix cache from a short one's
        with the same first tokens."""
        return b"long-rope" if self.is_long(request) else b""

    def rows(self, positions: torch.Tensor, long: list[bool], lens: list[int]) -> torch.Tensor:
        """Each token's row: its position, ``long_offset`` on for a long request's."""
        per_token = torch.repeat_interleave(torch.tensor(long), torch.tensor(lens))
        return positions + self.long_offset * per_token


def graph_input_shape(spec: GraphInput, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[dim] for dim in spec.dims)


def sizes_for(num_tokens: int, num_reqs: int, **others: int) -> dict[str, int]:
    return {"tokens": num_tokens, "requests": num_reqs, "requests+1": num_reqs + 1, **others}


class Query(NamedTuple):
    """One request's tokens in a step."""

    request: Request
    start: int  # position of the first token
    tokens: list[int]  # known tokens, then the draft's
    draft: Draft | None = None
    samples: bool = True  # read logits at the last known token and at each draft


@dataclass(frozen=True)
class ForwardInputs:
    """What one forward reads: the declared graph inputs, host tensors (or device
    tensors, for a draft head's hidden states)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    block_table: torch.Tensor  # [num_reqs, widest block list]
    seq_lens: torch.Tensor  # [num_reqs] context length after this step
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    # [num_tokens, hidden]: the target's hidden states a draft head reads beside this
    # step's tokens; None for every other model.
    hidden_states: torch.Tensor | None = None
    # [num_tokens]: the rotary table's row per token, for a LongRoPE model; else None.
    rotary_rows: torch.Tensor | None = None
    # [num_reqs]: each request's recurrent-state slot (-1: none), which only a model
    # with linear-attention layers reads.
    state_slots: torch.Tensor | None = None
    # [num_tokens] and [num_reqs, widest block list]: the slots and block table of the
    # windowed layers' own pool, for a model that keeps one; else None.
    window_slot_mapping: torch.Tensor | None = None
    window_block_table: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.numel()

    @cached_property
    def query_starts(self) -> list[int]:
        """``query_start_loc`` as a host list, read once per step."""
        return self.query_start_loc.tolist()

    @cached_property
    def query_lens(self) -> list[int]:
        return [end - start for start, end in pairwise(self.query_starts)]

    @cached_property
    def num_decodes(self) -> int:
        """The leading requests with exactly one query token."""
        return next((i for i, n in enumerate(self.query_lens) if n != 1), self.num_reqs)


@dataclass(frozen=True)
class SamplingInputs:
    """Per request that samples, in step order: what the logits are read at and how the
    tokens are drawn or verified. No forward reads it."""

    rows: list[int]  # their index among the step's requests
    # Per sampling request: its last known token, then its drafts; then prompt_rows.
    logits_indices: torch.Tensor
    num_drafts: list[int]
    draft_token_ids: torch.Tensor  # [sampling requests, most drafts]; 0 past num_drafts
    draft_probs: list[torch.Tensor | None]  # q [num_drafts, vocab], or None: one-hot
    batch: SamplingBatch  # their sampling parameters and generators
    # What the requests change in their logits rows (penalties, biases, bad words, ...).
    adjustments: LogitsAdjustments = NO_ADJUSTMENTS
    prompt_rows: PromptRows | None = None  # tokens of prompts whose logprobs are asked for

    @property
    def num_sampling_rows(self) -> int:
        """The logits rows sampling and verification read (the prompt rows follow)."""
        return len(self.logits_indices) - (0 if self.prompt_rows is None else len(self.prompt_rows))

    @classmethod
    def of(
        cls,
        rows: list[int],
        requests: list[Request],
        drafts: list[Draft | None],
        logits: array,
        prompt_rows: PromptRows | None = None,
    ) -> SamplingInputs:
        """The sampling rows ``rows`` of a step: their requests, their drafts and where
        their logits are read (``logits`` ends with the prompt rows' indices)."""
        num_drafts = [0 if draft is None else len(draft.token_ids) for draft in drafts]
        widest = max(num_drafts, default=0)
        draft_token_ids = array("q")
        for draft, count in zip(drafts, num_drafts, strict=True):
            if count:
                draft_token_ids.extend(draft.token_ids)
            draft_token_ids.extend(zeros(widest - count))
        return cls(
            rows=rows,
            logits_indices=long_tensor(logits),
            num_drafts=num_drafts,
            draft_token_ids=long_tensor(draft_token_ids).view(len(drafts), widest),
            draft_probs=[None if draft is None else draft.probs for draft in drafts],
            batch=SamplingBatch(
                [r.sampling_params for r in requests], [r.generator for r in requests]
            ),
            adjustments=logits_adjustments(
                requests, [[] if draft is None else draft.token_ids for draft in drafts]
            ),
            prompt_rows=prompt_rows,
        )


@dataclass(frozen=True)
class StepInputs:
    request_ids: list[str]  # in step order: decodes first
    forward: ForwardInputs
    sampling: SamplingInputs
    return_hidden_states: bool = False
    # Per request: the token after its last query token where that is already known (a
    # prompt prefilled in chunks), else -1. What a draft head pairs with the chunk's
    # last hidden state (speculative/head.py).
    next_token_ids: list[int] = field(default_factory=list)
    # A hybrid model's states moved between slots before the forward, in order (prefix
    # states saved and restored, ``engine/prefix_states.py``): host data every runner
    # of the step applies to its own state tensors, no graph input.
    state_copies: tuple[StateCopy, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.forward.num_tokens

    @property
    def num_reqs(self) -> int:
        return self.forward.num_reqs

    @classmethod
    def build(
        cls,
        plan: StepPlan,
        positions_per_block: int,
        return_hidden_states: bool = False,
        rotary: RotarySwitch | None = None,
    ) -> StepInputs:
        """The step the scheduler planned: each request's next known tokens from its
        first uncomputed one, then the drafts it verifies. Decodes come first."""
        queries = []
        for item in sorted(plan.scheduled, key=lambda item: item.num_new_tokens != 1):
            request, draft = item.request, item.draft
            start = request.num_computed_tokens
            tokens = request.token_ids[start : start + item.num_new_tokens - item.num_drafts]
            if draft is not None:
                tokens += draft.token_ids
            # A plain tuple in Query's field order: this runs for every request per step.
            queries.append((request, start, tokens, draft, item.samples))
        inputs = cls.from_queries(
            queries, positions_per_block, return_hidden_states, rotary, prompt_logprobs=True
        )
        if plan.state_copies:
            inputs = replace(inputs, state_copies=tuple(plan.state_copies))
        return inputs

    @classmethod
    def from_queries(
        cls,
        queries: list[Query],
        positions_per_block: int,
        return_hidden_states: bool = False,
        rotary: RotarySwitch | None = None,
        prompt_logprobs: bool = False,
    ) -> StepInputs:
        """One forward over ``queries``, in order (a proposer's own draft steps); with
        ``prompt_logprobs``, rows scoring the prompt tokens of requests that ask.

        Work is per request and, for slots, per block a request touches: token runs are
        copied with ``extend``, never a Python loop over tokens. Host time here is mostly
        cache misses after a forward has streamed the weights, so a few flat arrays
        turned into tensors without copying beat many small array operations."""
        input_ids, positions, slot_mapping = array("q"), array("q"), array("q")
        # A request's windowed blocks, when its model keeps them in a pool of their own.
        windowed = any(q[0].window_block_ids for q in queries)
        window_slots = array("q")
        query_start_loc, seq_lens = array("q", [0]), array("q")
        logits_indices = array("q")
        rows: list[int] = []
        next_token_ids: list[int] = []
        drafts: list[Draft | None] = []
        scored = ScoredPrompts()
        end_of_queries = 0
        per_block = positions_per_block
        for row, (request, start, tokens, draft, samples) in enumerate(queries):
            end = start + len(tokens)
            block_ids = request.block_ids
            if end > len(block_ids) * per_block:
                raise RuntimeError(
                    f"request {request.request_id} has {len(block_ids)} KV blocks, too few "
                    f"for its tokens up to position {end - 1}"
                )
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            extend_slots(slot_mapping, block_ids, start, end, per_block)
            if windowed:
                extend_slots(window_slots, request.window_block_ids, start, end, per_block)
            if prompt_logprobs and request.sampling_params.prompt_logprobs is not None:
                scored.add(request, start, end, end_of_queries)
            end_of_queries += len(tokens)
            query_start_loc.append(end_of_queries)
            seq_lens.append(end)
            next_token_ids.append(-1 if samples else request.token_ids[end])
            if samples:
                count = 0 if draft is None else len(draft.token_ids)
                rows.append(row)
                drafts.append(draft)
                logits_indices.extend(range(end_of_queries - 1 - count, end_of_queries))
        sampled = [queries[row][0] for row in rows]
        prompt_rows = scored.rows()
        if prompt_rows is not None:
            logits_indices.extend(scored.indices)
        positions = long_tensor(positions)
        rotary_rows = None
        if rotary is not None:
            long = [rotary.is_long(q[0]) for q in queries]
            rotary_rows = rotary.rows(positions, long, [len(q[2]) for q in queries])
        return cls(
            request_ids=[q[0].request_id for q in queries],
            forward=ForwardInputs(
                input_ids=long_tensor(input_ids),
                positions=positions,
                slot_mapping=long_tensor(slot_mapping),
                block_table=block_table_of([q[0].block_ids for q in queries]),
                seq_lens=long_tensor(seq_lens),
                query_start_loc=long_tensor(query_start_loc),
                rotary_rows=rotary_rows,
                state_slots=torch.tensor([q[0].state_slot for q in queries], dtype=torch.long),
                window_slot_mapping=long_tensor(window_slots) if windowed else None,
                window_block_table=(
                    block_table_of([q[0].window_block_ids for q in queries]) if windowed else None
                ),
            ),
            sampling=SamplingInputs.of(rows, sampled, drafts, logits_indices, prompt_rows),
            return_hidden_states=return_hidden_states,
            next_token_ids=next_token_ids,
        )


def extend_slots(slots: array, block_ids: list[int], start: int, end: int, per_block: int) -> None:
    """Append the cache slots of positions ``start .. end - 1`` through ``block_ids``, a
    run per block rather than a Python step per token."""
    for index in range(start // per_block, (end - 1) // per_block + 1):
        first = block_ids[index] * per_block - index * per_block
        low, high = max(start, index * per_block), min(end, (index + 1) * per_block)
        slots.extend(range(first + low, first + high))


class ScoredPrompts:
    """Collects a step's prompt rows as its queries are laid out."""

    def __init__(self) -> None:
        self.indices = array("q")
        self.targets = array("q")
        self.request_ids: list[str] = []
        self.first_positions: list[int] = []
        self.counts: list[int] = []
        self.top: list[int] = []

    def add(self, request: Request, start: int, end: int, first_index: int) -> None:
        """The query's tokens at positions ``start..end - 1`` sit from logits row
        ``first_index``; those before the prompt's last token score the next one."""
        stop = min(end, request.num_prompt_tokens - 1)
        if stop <= start:
            return
        self.indices.extend(range(first_index, first_index + stop - start))
        self.targets.extend(request.token_ids[start + 1 : stop + 1])
        self.request_ids.append(request.request_id)
        self.first_positions.append(start + 1)
        self.counts.append(stop - start)
        self.top.append(request.sampling_params.prompt_logprobs)

    def rows(self) -> PromptRows | None:
        if not self.request_ids:
            return None
        return PromptRows(
            self.request_ids, self.first_positions, self.counts, self.top, long_tensor(self.targets)
        )


ZEROS = array("q", bytes(8 * 1024))  # padding to copy from


def zeros(count: int) -> array:
    return ZEROS[:count] if count <= len(ZEROS) else array("q", bytes(8 * count))


def block_table_of(block_lists: list[list[int]]) -> torch.Tensor:
    """Block tables [len(block_lists), widest], zero past each list's end."""
    width = max(map(len, block_lists), default=1) or 1
    table = array("q")
    for block_ids in block_lists:
        table.extend(block_ids)
        table.extend(zeros(width - len(block_ids)))
    return long_tensor(table).view(len(block_lists), width)


def long_tensor(values: array) -> torch.Tensor:
    """An int64 tensor over ``values``'s memory, without a copy."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(values, dtype=torch.long)


def pad_inputs(
    inputs: ForwardInputs,
    num_tokens: int,
    num_reqs: int,
    specs: tuple[GraphInput, ...] = GRAPH_INPUTS,
    **other_sizes: int,
) -> ForwardInputs:
    """``inputs`` grown to ``num_tokens`` tokens and ``num_reqs`` requests by padding
    every graph input as its declaration says."""
    if num_tokens < inputs.num_tokens or num_reqs < inputs.num_reqs:
        raise ValueError(
            f"cannot pad a step of {inputs.num_tokens} tokens / {inputs.num_reqs} requests "
            f"down to {num_tokens} / {num_reqs}"
        )
    sizes = sizes_for(num_tokens, num_reqs, blocks=inputs.block_table.shape[1], **other_sizes)
    grown = {
        spec.name: padded(getattr(inputs, spec.name), graph_input_shape(spec, sizes), spec.pad)
        for spec in specs
    }
    return replace(inputs, **grown)


def empty_inputs(specs: tuple[GraphInput, ...], cls: type, sizes: dict[str, int]) -> Any:
    """A ``cls`` (whose fields the specs name) of no request at all: what a graph is
    captured over. Its refresh pads every row of the bucket's buffers (slot -1: no live
    KV is written), and every replay refreshes all of it. ``sizes``: of the dims the
    specs name beyond tokens and requests."""
    nothing = {**sizes, **sizes_for(0, 0)}
    return cls(
        **{
            spec.name: torch.zeros(
                graph_input_shape(spec, nothing), dtype=spec.dtype or torch.get_default_dtype()
            )
            for spec in specs
        }
    )
