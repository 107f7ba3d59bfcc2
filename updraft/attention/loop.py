"""The attention loop: every attention layer, of every kind, attends through ``attend``.

A step's requests come in groups (all decodes; the rest: ``metadata.shapes``). For each
group the loop reads the cache one of two ways:

* in place, through updraft's CPU kernel (float32 on the CPU): groups whose longest
  query is at most ``IN_PLACE_MAX_QUERY`` tokens (decodes, verify steps), each query
  token as a one-token request over its causal context, or over the slots a selection
  chose for it;
* gathered: the group's context through the block table into one padded attention
  call (prefill chunks, and everything the kernel does not serve).

What it reads is the ``CacheReader`` it is given: a small tuple of a layer's queries and
its cache, which knows how to read that kind of cache in place and how to gather it
(``gqa.py``: paged keys and values; ``latent.py``: MLA's latent rows). A ``Selector``
(DSA's top-k) narrows each query to the context positions it chooses. A layer's sliding
window narrows each query to its last ``window`` positions, on both paths: the kernel
starts reading there, and the gathered mask drops what lies before. Padding tokens of a
graph bucket, which belong to no group, get output 0 here, once.

Under decode context parallelism (``metadata.context.decode``) the same loop attends
over this rank's shard of every context, and returns each head's log-sum-exp beside its
output for ``context_parallel.py`` to merge the shards by.

A layer with attention sinks (gpt-oss: one learned logit per query head that joins each
softmax's denominator and adds no value) has them applied once, after every group, from
the log-sum-exp each path returns (``merge.with_sinks``); under decode context
parallelism after the shards' merge instead, which knows the whole context's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from updraft.attention.in_place import IN_PLACE_MAX_QUERY, reads_cache_in_place
from updraft.attention.merge import with_sinks
from updraft.attention.metadata import AttentionGroup, AttentionMetadata
from updraft.graph.tasks import register_task

Attended = tuple[torch.Tensor, torch.Tensor]  # out [t, H, Dv]; lse [t, H], or empty


class InPlaceRows(NamedTuple):
    """What the kernel reads for a group: per query token a block-table row, how many
    positions of it are its context and (under a sliding window) the first of them it
    reads, and how many slots make a block."""

    block_table: torch.Tensor  # [t, blocks]
    seq_lens: torch.Tensor  # [t]
    starts: torch.Tensor | None  # [t]
    slots_per_block: int


class CacheReader(Protocol):
    """One attention kind's queries and cache, as the loop reads them. A NamedTuple, so
    a captured task sees the tensors it holds."""

    query: torch.Tensor  # [T, H, D]: every token of the step
    scale: float  # of the scores

    @property
    def value_dim(self) -> int: ...

    def in_place(self, tokens: slice, rows: InPlaceRows, with_lse: bool) -> Attended:
        """The group ``tokens``' attention, each query token reading its context
        through its row with the kernel."""
        ...

    def gathered(
        self, tokens: slice, group: AttentionGroup, mask: torch.Tensor, with_lse: bool
    ) -> Attended:
        """The group's attention over its context gathered into one padded call."""
        ...


class Selection(NamedTuple):
    """A sparse attention's choice for one group: per query row of the padded group
    [B, Qmax], context columns [B, Qmax, k] of which the first ``count`` are chosen."""

    chosen: torch.Tensor
    count: torch.Tensor

    @classmethod
    def best(cls, scores: torch.Tensor, k: int) -> Selection:
        """The ``k`` highest ``scores`` [B, Q, K] of each row (all of them where fewer
        are finite: -inf marks a position outside the context, and sorts last)."""
        k = min(k, scores.shape[-1])
        chosen = scores.topk(k, dim=-1).indices
        return cls(chosen, scores.isfinite().sum(dim=-1).clamp(max=k))

    @classmethod
    def within(cls, picked: torch.Tensor, k: int) -> Selection:
        """The True columns of ``picked`` [B, Q, K], of which no row has more than k."""
        k = min(k, picked.shape[-1])
        chosen = picked.float().topk(k, dim=-1).indices  # the picked ones sort first
        return cls(chosen, picked.sum(dim=-1))

    def columns(self, max_context: int) -> torch.Tensor:
        """[B, Qmax, Kmax]: True where a query attends."""
        ranks = torch.arange(self.chosen.shape[-1], device=self.chosen.device)
        keep = ranks < self.count[..., None]
        empty = torch.zeros(
            *self.chosen.shape[:-1], max_context, dtype=torch.bool, device=keep.device
        )
        return empty.scatter(-1, self.chosen, keep)

    def token_rows(self, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query token of the group, in order: the slots of its chosen context as a
        block table of one-slot blocks [t, k], and how many there are [t]."""
        batch, max_query, k = self.chosen.shape
        slots = group.kv_slots.gather(1, self.chosen.view(batch, max_query * k))
        table = slots.view(batch * max_query, k).index_select(0, group.output_index)
        return table, self.count.flatten().index_select(0, group.output_index)


class Selector(Protocol):
    """Chooses, for each query of a group, the context positions it attends to."""

    def choose(self, group: AttentionGroup) -> Selection: ...


def attend(
    reader: CacheReader,
    metadata: AttentionMetadata,
    selector: Selector | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reader's queries [T, H, D] over each group's context (its last ``window``
    positions, for a sliding-window layer) -> [T, H * Dv], each head's softmax with its
    sink's logit (``sinks`` [H]) in the denominator where a layer has them; under
    decode context parallelism [T, H * Dv + H] in float32: the attention over this
    rank's shard of each context, then each head's log-sum-exp (-inf, or the kernel's
    -1e30, where the shard holds none of a token's context), sinks left to the merge.
    A windowed layer reads through the windowed pool's view of ``metadata``, where the
    model keeps one: chosen here, so a task re-run with a step's fresh metadata (which
    is the whole step's) picks the fresh view."""
    if window is not None and selector is not None:
        raise ValueError("a sliding window and a sparse selection do not combine")
    metadata = metadata.for_window(window)
    sharded = metadata.context.decode is not None
    with_lse = sharded or sinks is not None
    in_place = reads_cache_in_place(reader.query)
    outputs, lses = [], []
    for index, shape in enumerate(metadata.shapes):
        tokens = slice(shape.first_token, shape.last_token)
        chosen = None if selector is None else selector.choose(metadata.group(index))
        if in_place and shape.max_query <= IN_PLACE_MAX_QUERY:
            if chosen is None:
                rows = InPlaceRows(*metadata.in_place_rows(index, window), metadata.slots_per_block)
            else:  # each query token's chosen slots, as blocks of one slot
                rows = InPlaceRows(*chosen.token_rows(metadata.group(index)), None, 1)
            out, lse = reader.in_place(tokens, rows, with_lse)
        else:
            group = metadata.group(index)
            mask = (
                metadata.mask(index, window)
                if chosen is None
                else chosen.columns(group.kv_slots.shape[1])[:, None]
            )
            out, lse = reader.gathered(tokens, group, mask, with_lse)
        outputs.append(out)
        lses.append(lse)
    heads, count = reader.query.shape[1], metadata.num_padding_tokens
    if count or not outputs:
        dtype = torch.float32 if with_lse else reader.query.dtype
        outputs.append(reader.query.new_zeros(count, heads, reader.value_dim, dtype=dtype))
        lses.append(reader.query.new_full((count, heads), float("-inf"), dtype=torch.float32))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if not with_lse:
        return out.flatten(1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses)
    if not sharded:
        return with_sinks(out, lse, sinks).to(reader.query.dtype).flatten(1)
    return torch.cat([out.float().flatten(1), lse], dim=1)


def attend_padded(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: AttentionGroup,
    mask: torch.Tensor,
    scale: float,
    with_lse: bool,
    first_token: int = 0,
) -> Attended:
    """query [tokens, H, D] (the flat batch from ``first_token`` on), the group's
    context keys [B * Kmax, Hkv, D] and values [B * Kmax, Hkv, Dv], masked by ``mask``
    [B, 1, Qmax, Kmax] -> the group's tokens [t, H, Dv]; with ``with_lse``, in float32
    and with each head's log-sum-exp [t, H] (-inf where a token sees nothing)."""
    q, k, v = group.batched(query, keys, values, first_token)
    rows = group.output_index
    if not with_lse:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.transpose(1, 2).flatten(0, 1).index_select(0, rows), query.new_empty(0)
    q, k, v = q.float(), k.float(), v.float()
    value_dim = v.shape[-1]
    if k.shape[1] != q.shape[1]:  # grouped-query heads read their KV head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    no_context = ~mask.any(dim=-1)  # [B, 1, L]: a token that sees none of this context
    if q.device.type == "cpu":
        # The fused CPU kernel returns the log-sum-exp beside the output, in blocks,
        # without the [B, H, L, K] scores a long prefill chunk would spill to memory.
        # It wants one head size: narrower values are padded, and cut from the output.
        # (An aten op, the one SDPA itself dispatches to here; its name is underscored.)
        v = F.pad(v, (0, q.shape[-1] - value_dim))
        bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # noqa: SLF001
        out, lse = flash(q, k, v, attn_mask=bias, scale=scale)
        out = out[..., :value_dim]
    else:
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, L]
        out = torch.exp(scores - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1)) @ v
    out = out.masked_fill(no_context.unsqueeze(-1), 0.0)
    lse = lse.masked_fill(no_context, float("-inf"))
    return (
        out.transpose(1, 2).flatten(0, 1).index_select(0, rows),
        lse.transpose(1, 2).flatten(0, 1).index_select(0, rows),
    )


def attention_op(
    op: Callable[..., torch.Tensor], kwargs: dict[str, Any], layer: str, metadata: AttentionMetadata
) -> torch.Tensor:
    """Attention with the step's group shapes is a task of ``layer``, its ``metadata``
    made fresh at every replay (a PIECEWISE graph on CUDA). With a bucket's own shapes
    (``metadata.uniform``) it has no per-step host parameter, so it runs as plain ops a
    graph holds whole (FULL)."""
    if metadata.uniform:
        return op(**kwargs)
    return register_task(op, kwargs, layer)
