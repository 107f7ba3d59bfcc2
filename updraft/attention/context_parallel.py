"""Attention when the context may be split over ranks: the one entry of every attention
layer (``attention``) and what it writes (``step_rows``).

Prefill context parallelism (PCP): each rank of a group runs its own chunks of the
step's long prefills. Before attending, every rank's cache rows of the step are
all-gathered and written at their global slots, so each rank's cache holds the whole
context and its chunks attend to it as chunked-prefill continuations.

Decode context parallelism (DCP): the C ranks of a group keep the same KV heads, and
each stores every C-th position: the token whose global slot is s (position x, block
b, of ``C * slots_per_block`` positions per block) lives on rank s mod C at local slot
s div C, which is position x div C's place in the same block of ``slots_per_block``
local slots. Every rank all-gathers the group's query heads, runs the attention loop
with them over its own positions (which returns the log-sum-exp beside the output),
and then merges its own heads' shards exactly (``merge.py``). A selector (sparse
attention's top-k) is wrapped so that every rank chooses from every rank's scores.

How the context is split rides on the attention metadata (``metadata.context``): the
layers here read nothing else about it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from updraft.attention.loop import CacheReader, Selection, Selector, attend, attention_op
from updraft.attention.merge import merge_attention_shards
from updraft.attention.metadata import AttentionGroup, AttentionMetadata
from updraft.parallel import collectives  # noqa: F401 (registers the collective ops)
from updraft.parallel.topology import GroupRank


def attention(
    reader: CacheReader,
    metadata: AttentionMetadata,
    layer: str,
    selector: ScoredSelector | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reader's queries [T, H, D] attended over the step's contexts (each query's
    last ``window`` positions, for a sliding-window layer; each head's sink logit,
    ``sinks`` [H], in its softmax's denominator) -> [T, H * Dv].
    The loop is a task (its group shapes change every step) unless the metadata is a
    bucket's (a FULL graph holds it); under decode context parallelism it runs with the
    group's query heads over this rank's positions, between two all-gathers, and the
    sinks join the merge of this rank's heads. A windowed layer reads through the
    windowed pool's view, where the model keeps one (``attend`` picks it: a task's
    fresh metadata is the whole step's)."""
    shard = metadata.context.decode
    kwargs = {"reader": reader, "metadata": metadata, "selector": selector, "window": window}
    if shard is None:
        return attention_op(attend, {**kwargs, "sinks": sinks}, layer, metadata)
    tokens, heads, width = reader.query.shape
    queries = torch.ops.updraft.all_gather_last(reader.query.flatten(1), shard.group, shard.size)
    kwargs["reader"] = reader._replace(query=queries.view(tokens, shard.size * heads, width))
    if selector is not None:
        kwargs["selector"] = ShardedSelection(selector, shard)
    out = attention_op(attend, kwargs, layer, metadata)
    gathered = torch.ops.updraft.all_gather_last(out, shard.group, shard.size)
    merged = merge_own_heads(gathered, shard, heads, reader.value_dim, sinks)
    return merged.to(reader.query.dtype)


def step_rows(
    metadata: AttentionMetadata, *parts: torch.Tensor, window: int | None = None
) -> tuple[torch.Tensor, ...]:
    """(slots, *parts): this step's cache rows (``parts``, [T, ...] each) and the slots
    this rank writes them at (a ``window``ed layer's in the windowed pool, where the
    model keeps one). Under a prefill split, every rank's rows of the step (in one
    all-gather) at their global slots; under a decode split, the positions this rank
    keeps at its local slots, and -1 (the spare slot) for the others."""
    metadata = metadata.for_window(window)
    context, slots = metadata.context, metadata.slot_mapping
    if context.prefill is not None:
        gather = context.prefill
        both = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        gathered = torch.ops.updraft.all_gather(both, gather.group, gather.size)
        parts = gathered.split([part.shape[1] for part in parts], dim=1)
        slots = gather.kv_slot_mapping
    if context.decode is not None:
        slots = shard_slots(slots, context.decode)
    return (slots, *parts)


def shard_slots(slot_mapping: torch.Tensor, rank: GroupRank) -> torch.Tensor:
    """Global slots -> this rank's local slots under DCP; -1 where another rank keeps
    the position (and where no one does)."""
    mine = (slot_mapping >= 0) & (slot_mapping.remainder(rank.size) == rank.rank)
    return torch.where(mine, slot_mapping.div(rank.size, rounding_mode="floor"), -1)


class ScoredSelector(Selector, Protocol):
    """A selector that takes the ``topk`` best-scored positions of each query's context."""

    @property
    def topk(self) -> int: ...

    def scores(self, group: AttentionGroup) -> torch.Tensor:
        """[B, Qmax, Kmax] per query row of the padded group, -inf outside the context."""
        ...


class ShardedSelection(NamedTuple):
    """A scored selector over a context split by DCP: every rank scores its own
    positions, the scores are all-gathered, every rank takes the same top-k of the whole
    context, and each keeps the chosen positions that are its own. Local position j on
    rank r is global position j * C + r."""

    selector: ScoredSelector
    shard: GroupRank

    def choose(self, group: AttentionGroup) -> Selection:
        scores = self.selector.scores(group)  # [B, Q, K] over this rank's positions
        size = self.shard.size
        every = torch.ops.updraft.all_gather(scores[None], self.shard.group, size)
        batch, max_query, columns = scores.shape
        totals = every.permute(1, 2, 3, 0).reshape(batch, max_query, columns * size)
        picked = Selection.best(totals, self.selector.topk).columns(columns * size)
        mine = picked.view(batch, max_query, columns, size)[..., self.shard.rank]
        return Selection.within(mine, self.selector.topk)


def merge_own_heads(
    shards: torch.Tensor,
    rank: GroupRank,
    heads: int,
    dim: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every rank's shard attention, gathered along the last dim
    [T, C * (C * heads * dim + C * heads)] -> this rank's ``heads`` merged over the
    shards (with their sinks, ``sinks`` [heads]), [T, heads * dim]."""
    size, tokens = rank.size, shards.shape[0]
    width = size * heads * dim
    parts = shards.view(tokens, size, width + size * heads)
    outs = parts[..., :width].reshape(tokens, size, size, heads, dim)[:, :, rank.rank]
    lse = parts[..., width:].reshape(tokens, size, size, heads)[:, :, rank.rank]
    return merge_attention_shards(outs.transpose(0, 1), lse.transpose(0, 1), sinks).flatten(1)
