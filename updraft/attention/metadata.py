"""Attention metadata: what every attention layer of one forward shares.

Three parts. Tensors (slot mapping, block table, seq_lens, query_start_loc) that a
captured graph holds as declared static inputs; host-side shape facts (how many decodes,
the longest query and context of each group) that change every step and so are made
fresh for the attention tasks at each replay; and how this rank's context is split over
ranks (``ContextSplit``: not at all, a prefill split, a decode split), which the runner
builds from the rank's place and, for a prefill split, from the step. The gather indices
and masks are derived from the tensors, once per step, on the first layer's call: eager
and captured forwards run the same code, and a stale tensor shows up in the output.

Requests are split into groups of one shape class (all decodes; the rest, in runs of
similar length) so that one padded attention call serves each group without padding
every decode up to the longest prefill, or a short prompt up to a long one.

Two sizes of a block: ``positions_per_block`` is how many positions of a sequence one
block-table entry covers, as the scheduler counts them; ``slots_per_block`` is how many
cache slots of this rank's cache one block has. They differ under decode context
parallelism over C ranks, where each rank keeps every C-th position of a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from updraft.parallel.topology import GroupRank
from updraft.step.inputs import ForwardInputs


@dataclass(frozen=True)
class PrefillGather:
    """A prefill split's part of the context split: this rank runs its chunks of the
    step's long prefills, and every rank's K/V of the step is written here, at the slots
    of every rank's tokens in the order the K/V all-gather returns them (each rank's
    tokens, padded to the same count with slot -1)."""

    group: str
    size: int
    kv_slot_mapping: torch.Tensor


@dataclass(frozen=True)
class ContextSplit:
    """How this rank's forward splits context over ranks: with ``prefill``, the step is
    this rank's chunks of a prefill split (``step/prefill_split.py``); with ``decode``,
    this rank's cache keeps every C-th position of each block (decode context
    parallelism over that group). Neither: the rank holds every position."""

    prefill: PrefillGather | None = None
    decode: GroupRank | None = None

    @property
    def shards(self) -> int:
        """How many ranks share each block's positions."""
        return 1 if self.decode is None else self.decode.size


NO_SPLIT = ContextSplit()


@dataclass(frozen=True)
class GroupShape:
    """Host-side shape of one group: requests [first_req, last_req), tokens
    [first_token, last_token), padded to max_query x max_context."""

    first_req: int
    last_req: int
    first_token: int
    last_token: int
    max_query: int
    max_context: int


def token_owners(
    shape: GroupShape, query_start_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's token indices in the flat batch, and the index within the group of
    the request each belongs to."""
    ends = query_start_loc[shape.first_req + 1 : shape.last_req + 1]
    tokens = torch.arange(shape.first_token, shape.last_token, device=ends.device)
    return tokens, torch.searchsorted(ends, tokens, right=True)


def context_slots(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The cache slot of each of ``positions`` [K] for each block-table row: [rows, K]."""
    return block_table.index_select(1, positions // block_size) * block_size + (
        positions % block_size
    )


@dataclass
class AttentionGroup:
    """Index tensors for one padded attention call.

    ``query_index`` [B, Qmax] picks each request's query tokens out of the flat batch;
    ``kv_slots`` [B, Kmax] names the KV-cache slot of each context position (through the
    block table); ``mask`` [B, 1, Qmax, Kmax] is causal and length-limited;
    ``output_index`` picks the group's real tokens, in order, out of the padded output.
    ``query_positions`` [B, 1, Qmax, 1] and ``key_positions`` [Kmax] are the positions of
    each query row and context column, what a sliding window narrows the mask by.
    """

    query_index: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    output_index: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor

    def window_mask(self, window: int) -> torch.Tensor:
        """``mask`` narrowed to a sliding window: a query at position p sees the
        ``window`` positions p - window + 1 .. p (transformers' ``kv > q - window``)."""
        return self.mask & (self.key_positions > self.query_positions - window)

    @classmethod
    def build(
        cls,
        shape: GroupShape,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        shard: tuple[int, int] = (0, 1),
    ) -> AttentionGroup:
        """Fixed-shape tensor ops only: no host sync, so a graph can hold them.

        ``shard`` (r, C): the context is this rank's shard of it under decode context
        parallelism, positions r, r + C, r + 2C... at local offsets 0, 1, 2... of its
        blocks (``block_size / C`` slots each)."""
        rank, shards = shard
        device = block_table.device
        starts_ends = query_start_loc[shape.first_req : shape.last_req + 1]
        starts = starts_ends[:-1]
        query_lens = starts_ends[1:] - starts
        rows = torch.arange(shape.max_query, device=device)
        columns = torch.arange(-(-shape.max_context // shards), device=device)
        # Padded query rows repeat the request's last real token: any valid index will do,
        # their output is never read.
        last_row = (query_lens - 1).clamp(min=0)
        query_index = starts[:, None] + torch.minimum(rows[None], last_row[:, None])
        kv_slots = context_slots(
            block_table[shape.first_req : shape.last_req], columns, block_size // shards
        )
        context_before = seq_lens[shape.first_req : shape.last_req] - query_lens
        positions = columns * shards + rank if shards > 1 else columns
        mask = (rows[None, :, None] < query_lens[:, None, None]) & (
            positions[None, None, :] <= context_before[:, None, None] + rows[None, :, None]
        )
        tokens, owner = token_owners(shape, query_start_loc)
        output_index = owner * shape.max_query + tokens - starts.index_select(0, owner)
        query_positions = (context_before[:, None] + rows[None])[:, None, :, None]
        return cls(query_index, kv_slots, mask[:, None], output_index, query_positions, positions)

    def batched(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_token: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The group's query tokens (of the flat batch from ``first_token`` on) and its
        context's keys and values [B * Kmax, Hkv, D] as padded batches for one
        attention call: [B, H, Qmax, D], [B, Hkv, Kmax, D], [B, Hkv, Kmax, Dv]."""
        batch, max_query = self.query_index.shape
        max_context = self.kv_slots.shape[1]
        index = self.query_index.flatten()
        q = query.index_select(0, index - first_token if first_token else index)
        q = q.view(batch, max_query, *q.shape[1:]).transpose(1, 2)
        k = keys.view(batch, max_context, *keys.shape[1:]).transpose(1, 2)
        v = values.view(batch, max_context, *values.shape[1:]).transpose(1, 2)
        return q, k, v

    @classmethod
    def uniform(
        cls,
        shape: GroupShape,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        shard: tuple[int, int] = (0, 1),
    ) -> AttentionGroup:
        """A whole bucket of ``last_req`` requests of ``max_query`` tokens each, over
        every block of the block table (this rank's shard of it, as in ``build``):
        every shape is the bucket's, so nothing here depends on the step. A padding
        request (seq_len 0) attends to its first slot: a defined softmax whose output
        no one reads. (Its query tokens have no request in ``query_start_loc``, which
        is why a bucket is not ``build``'s business.)"""
        rank, shards = shard
        batch, max_query = shape.last_req, shape.max_query
        device = block_table.device
        rows = torch.arange(max_query, device=device)
        columns = torch.arange(-(-shape.max_context // shards), device=device)
        query_index = torch.arange(batch * max_query, device=device).view(batch, max_query)
        kv_slots = context_slots(block_table[:batch], columns, block_size // shards)
        context_before = seq_lens[:batch] - max_query
        positions = columns * shards + rank if shards > 1 else columns
        mask = positions[None, None, :] <= context_before[:, None, None] + rows[None, :, None]
        # Only padding requests need the first column: a real query's context holds
        # position 0 anyway, and where a shard's first column is not in it, the token
        # sees nothing of that shard, which the shards' log-sum-exps merge away.
        padding = (seq_lens[:batch] == 0)[:, None, None]
        mask = mask | ((columns == 0) & padding)
        # A padding request's query positions are negative: any window keeps column 0.
        query_positions = (context_before[:, None] + rows[None])[:, None, :, None]
        return cls(
            query_index, kv_slots, mask[:, None], query_index.flatten(), query_positions, positions
        )


@dataclass
class TokenRows:
    """A group's query tokens as requests of one token each, for the in-place decode
    kernel: token t of a request whose context is ``seq_len`` long and whose query ends
    at token ``end`` sees the first ``seq_len - (end - 1 - t)`` positions (causal), through
    its request's block-table row."""

    block_table: torch.Tensor  # [tokens, max_blocks]
    seq_lens: torch.Tensor  # [tokens]

    @classmethod
    def build(
        cls,
        shape: GroupShape,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
    ) -> TokenRows:
        first, last = shape.first_req, shape.last_req
        tokens, owner = token_owners(shape, query_start_loc)
        hidden_after = query_start_loc[first + 1 : last + 1].index_select(0, owner) - 1 - tokens
        lens = seq_lens[first:last].index_select(0, owner) - hidden_after
        return cls(block_table[first:last].index_select(0, owner), lens)

    @classmethod
    def uniform(
        cls, shape: GroupShape, seq_lens: torch.Tensor, block_table: torch.Tensor
    ) -> TokenRows:
        """The same for a whole bucket of requests of ``max_query`` tokens each; a
        padding request's tokens see nothing."""
        batch, max_query = shape.last_req, shape.max_query
        tokens = torch.arange(batch * max_query, device=block_table.device)
        owner = tokens // max_query
        hidden_after = max_query - 1 - tokens % max_query
        lens = (seq_lens[:batch].index_select(0, owner) - hidden_after).clamp(min=0)
        return cls(block_table[:batch].index_select(0, owner), lens)


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Frozen once built. The one exception is its lazy caches (``_groups``,
    ``_token_rows``, ``_window_masks``): index tensors derived from the fields on the
    first layer's call and shared by the later layers of the same forward."""

    slot_mapping: torch.Tensor  # [num_tokens] global slots; -1 writes into the spare slot
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    seq_lens: torch.Tensor  # [num_reqs]
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    shapes: tuple[GroupShape, ...]
    positions_per_block: int
    num_padding_tokens: int = 0  # trailing tokens of no request (a graph bucket's padding)
    # Shapes are a whole bucket's, over its whole block table (``bucket``): attention
    # then has no host-side parameter that changes per step, and a graph holds it whole.
    uniform: bool = False
    context: ContextSplit = NO_SPLIT
    # What linear-attention layers (which run no task) shape their work by:
    # ``query_len``, every request's query length when the step is one of uniform
    # length (a decode or verify bucket, captured or eager), else None; ``query_lens``,
    # each request's, read only by an eager step that is not uniform.
    query_len: int | None = None
    query_lens: tuple[int, ...] = ()
    # The same step over the windowed layers' own pool (its slots and block table), for
    # a model that keeps one (``engine/window_blocks.py``); None: every layer reads this.
    windowed: AttentionMetadata | None = None
    _groups: dict[int, AttentionGroup] = field(default_factory=dict, repr=False)
    _token_rows: dict[int, TokenRows] = field(default_factory=dict, repr=False)
    _window_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def slots_per_block(self) -> int:
        """Cache slots of one block on this rank."""
        return self.positions_per_block // self.context.shards

    def for_window(self, window: int | None) -> AttentionMetadata:
        """What a layer with ``window`` (None: full attention) reads and writes through:
        the windowed pool's view where the model keeps one, else this."""
        return self if window is None or self.windowed is None else self.windowed

    def with_window_pool(
        self, slot_mapping: torch.Tensor | None, block_table: torch.Tensor | None
    ) -> AttentionMetadata:
        """This metadata with a view over the windowed pool's ``slot_mapping`` and
        ``block_table`` (None: no such pool, itself): the same shapes and lengths, its
        own index tensors, derived on first use."""
        if block_table is None:
            return self
        view = replace(
            self,
            slot_mapping=slot_mapping,
            block_table=block_table,
            _groups={},
            _token_rows={},
            _window_masks={},
        )
        return replace(self, windowed=view)

    @classmethod
    def from_step(
        cls,
        step: ForwardInputs,
        positions_per_block: int,
        device: torch.device | str,
        context: ContextSplit = NO_SPLIT,
    ) -> AttentionMetadata:
        """Metadata over ``step``'s own tensors (eager forwards)."""
        windowed = step.window_block_table is not None
        return cls.bind(
            step,
            positions_per_block,
            slot_mapping=step.slot_mapping.to(device),
            block_table=step.block_table.to(device),
            seq_lens=step.seq_lens.to(device),
            query_start_loc=step.query_start_loc.to(device),
            context=context,
            window_slot_mapping=step.window_slot_mapping.to(device) if windowed else None,
            window_block_table=step.window_block_table.to(device) if windowed else None,
        )

    @classmethod
    def bind(
        cls,
        step: ForwardInputs,
        positions_per_block: int,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_tokens: int | None = None,
        context: ContextSplit = NO_SPLIT,
        window_slot_mapping: torch.Tensor | None = None,
        window_block_table: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Metadata over the given tensors holding ``step``'s values (a captured graph
        passes its static input buffers, ``num_tokens`` long), with ``step``'s
        host-side shapes; with the windowed pool's tensors, a view over them too.

        Decode requests (one query token) come first in a step, then the rest, then any
        padding requests (no query tokens), which attend to nothing."""
        shapes = group_shapes(step)
        num_real = shapes[-1].last_token if shapes else 0
        query_lens = tuple(step.query_lens)
        uniform_len = query_lens[0] if query_lens and len(set(query_lens)) == 1 else None
        return cls(
            slot_mapping=slot_mapping,
            block_table=block_table,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            shapes=shapes,
            positions_per_block=positions_per_block,
            num_padding_tokens=(step.num_tokens if num_tokens is None else num_tokens) - num_real,
            context=context,
            query_len=uniform_len,
            query_lens=query_lens,
        ).with_window_pool(window_slot_mapping, window_block_table)

    @classmethod
    def bucket(
        cls,
        positions_per_block: int,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_requests: int,
        query_len: int,
        context: ContextSplit = NO_SPLIT,
        window_slot_mapping: torch.Tensor | None = None,
        window_block_table: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Metadata of a bucket of ``num_requests`` requests of ``query_len`` tokens,
        whatever step fills it: one group, every request (padding ones see no context),
        over the block table's full width. What a FULL graph captures."""
        shape = GroupShape(
            first_req=0,
            last_req=num_requests,
            first_token=0,
            last_token=num_requests * query_len,
            max_query=query_len,
            max_context=block_table.shape[1] * positions_per_block,
        )
        return cls(
            slot_mapping=slot_mapping,
            block_table=block_table,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            shapes=(shape,),
            positions_per_block=positions_per_block,
            uniform=True,
            context=context,
            query_len=query_len,
        ).with_window_pool(window_slot_mapping, window_block_table)

    def group(self, index: int) -> AttentionGroup:
        """The index tensors of ``shapes[index]`` (over this rank's shard of every
        context under decode context parallelism), built on first use and shared by
        the later layers."""
        if index not in self._groups:
            shape, shard = self.shapes[index], self.context.decode
            shard = (0, 1) if shard is None else (shard.rank, shard.size)
            if self.uniform:
                group = AttentionGroup.uniform(
                    shape, self.seq_lens, self.block_table, self.positions_per_block, shard
                )
            else:
                group = AttentionGroup.build(
                    shape,
                    self.query_start_loc,
                    self.seq_lens,
                    self.block_table,
                    self.positions_per_block,
                    shard=shard,
                )
            self._groups[index] = group
        return self._groups[index]

    def token_rows(self, index: int) -> TokenRows:
        """``shapes[index]``'s tokens as one-token requests, built on first use and
        shared by the later layers."""
        if index not in self._token_rows:
            shape = self.shapes[index]
            self._token_rows[index] = (
                TokenRows.uniform(shape, self.seq_lens, self.block_table)
                if self.uniform
                else TokenRows.build(shape, self.query_start_loc, self.seq_lens, self.block_table)
            )
        return self._token_rows[index]

    def mask(self, index: int, window: int | None = None) -> torch.Tensor:
        """The padded mask of ``shapes[index]``, narrowed to ``window`` where one is
        given (built on first use per window, and shared by the layers that have it)."""
        group = self.group(index)
        if window is None:
            return group.mask
        key = (index, window)
        if key not in self._window_masks:
            self._window_masks[key] = group.window_mask(window)
        return self._window_masks[key]

    def in_place_rows(
        self, index: int, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the in-place kernel reads for ``shapes[index]``: a block-table row, a
        context length and (with a sliding ``window``) the first position read, per
        query token. Decodes are their requests' own rows; longer queries (verify steps)
        are their tokens as one-token requests. Under decode context parallelism the
        lengths are this rank's: of a context of n positions it keeps the first
        ceil((n - r) / C) slots of its blocks, and of a window from position s on, the
        slots from ceil((s - r) / C) on."""
        shape = self.shapes[index]
        if shape.max_query == 1:
            first, last = shape.first_req, shape.last_req
            block_table, seq_lens = self.block_table[first:last], self.seq_lens[first:last]
        else:
            rows = self.token_rows(index)
            block_table, seq_lens = rows.block_table, rows.seq_lens
        starts = None if window is None else (seq_lens - window).clamp(min=0)
        shard = self.context.decode
        if shard is not None:
            seq_lens = _local_count(seq_lens, shard)
            starts = None if starts is None else _local_count(starts, shard)
        return block_table, seq_lens, starts


def _local_count(positions: torch.Tensor, shard: GroupRank) -> torch.Tensor:
    """How many of global positions 0 .. n - 1 rank r of C keeps (those r, r + C, ...):
    ceil((n - r) / C), at least 0. Also the local slot of the first kept position at
    or after global position n."""
    return (
        (positions - shard.rank + shard.size - 1)
        .div(shard.size, rounding_mode="floor")
        .clamp(min=0)
    )


# A group's padded attention (requests x longest query x longest context) may cost at
# most this many times what its requests' own queries and contexts would: past it, the
# next request starts a group of its own.
MAX_PADDING = 1.5


def group_shapes(step: ForwardInputs) -> tuple[GroupShape, ...]:
    """The decodes as one group; the other requests in contiguous groups whose padding
    stays within ``MAX_PADDING`` (a chunk of prompts of 16 to 256 tokens, padded as one
    group, attends over several times the positions its prompts have)."""
    query_lens = step.query_lens
    query_start_loc = step.query_starts
    seq_lens = step.seq_lens.tolist()
    num_real = sum(1 for n in query_lens if n > 0)
    ranges = [(0, step.num_decodes)] if step.num_decodes else []
    ranges += similar_length_runs(query_lens, seq_lens, step.num_decodes, num_real)
    return tuple(
        GroupShape(
            first_req=first,
            last_req=last,
            first_token=query_start_loc[first],
            last_token=query_start_loc[last],
            max_query=max(query_lens[first:last]),
            max_context=max(seq_lens[first:last]),
        )
        for first, last in ranges
    )


def similar_length_runs(
    query_lens: list[int], seq_lens: list[int], first: int, last: int
) -> list[tuple[int, int]]:
    """Requests [first, last) as contiguous ranges, each padded to its longest query and
    context at most ``MAX_PADDING`` times the work of its requests alone."""
    ranges: list[tuple[int, int]] = []
    start, longest_query, longest_context, own = first, 0, 0, 0
    for index in range(first, last):
        query, context = query_lens[index], seq_lens[index]
        padded_query, padded_context = max(longest_query, query), max(longest_context, context)
        padded = (index - start + 1) * padded_query * padded_context
        if index > start and padded > MAX_PADDING * (own + query * context):
            ranges.append((start, index))
            start, padded_query, padded_context, own = index, query, context, 0
        longest_query, longest_context = padded_query, padded_context
        own += query * context
    if start < last:
        ranges.append((start, last))
    return ranges
