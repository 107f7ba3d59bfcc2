"""A model's caches as one description: groups of layers, each of one cache kind.

* **paged**: per-token K/V (or MLA's latent) in blocks of positions that every request
  pages through by its block table. One slot is one position; the pool of blocks and
  the prefix cache count blocks and never look inside. A model may have several paged
  groups, one per slot layout (Gemma 4's full-attention layers' heads differ from its
  sliding layers'): they share the one block table and block count, so a block is a
  block in every paged group and costs the sum of their bytes. A model that mixes
  sliding-window and full-attention layers may give its windowed groups a pool of their
  own (``CacheSizes.num_window_blocks``): their blocks then have ids of their own, in a
  block table of their own, and go back to that pool once every window has passed them
  (``engine/window_blocks.py``).
* **recurrent**: per-request state of linear-attention layers (Gated DeltaNet's causal
  conv window and recurrent state). A request holds one slot from admission to its end
  or preemption, whatever its length; a slot has ``depth`` rows, the state after
  positions p with ``p % depth`` equal to the row, so a verify step of up to ``depth``
  tokens leaves the state after each of them and the next step reads the one after its
  last accepted token (``models/delta_rule.py``).

Both kinds are paid for out of one memory budget (``split_budget``). Every cache has one
spare slot at its end that padded tokens (slot -1) and padded requests (state slot -1)
write into. The layers of a group share a layout and dtype; the list of caches handed to
a model has one tensor per decoder layer, in layer order. A KV-shared layer (Gemma 4's
``num_kv_shared_layers``) is in no group: it writes nothing, and its entry is the very
tensor of the layer whose KV it reads (``ModelConfig.kv_source``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from updraft.attention.cache_layout import CacheLayout, cache_layout, zeros_on_first_write
from updraft.attention.kv_int8 import dequantize_rows
from updraft.model_config import ModelConfig
from updraft.resident import mark_phase

PAGED = "paged"
RECURRENT = "recurrent"


@dataclass(frozen=True)
class CacheGroup:
    kind: str  # PAGED or RECURRENT
    layers: tuple[int, ...]
    # paged: one position's slot; recurrent: one request's slot ([depth, state width])
    layout: CacheLayout
    dtype: torch.dtype
    # paged: whether every layer of the group has a sliding window (the windowed kind)
    windowed: bool = False

    @property
    def bytes_per_slot(self) -> int:
        return len(self.layers) * self.layout.values_per_slot * self.dtype.itemsize


def cache_groups(
    config: ModelConfig,
    dtype: torch.dtype,
    state_dtype: torch.dtype = torch.float32,
    depth: int = 1,
) -> tuple[CacheGroup, ...]:
    """``config``'s cache groups (this rank's share of heads, when it is a rank's local
    config): the paged K/V of its attention layers in ``dtype`` (``torch.int8``: codes
    and a scale per head row, ``cache_layout``), and the recurrent
    state of its linear-attention layers in ``state_dtype``, ``depth`` rows per slot
    (1 + the speculative tokens a verify step carries)."""
    groups = []
    layouts: dict[tuple[CacheLayout, bool], list[int]] = {}
    for layer in config.kv_writing_layers:
        layout = cache_layout(config, layer, quantized=dtype == torch.int8)
        kind = (layout, config.window(layer) is not None)
        layouts.setdefault(kind, []).append(layer)
    for (layout, windowed), layers in layouts.items():
        groups.append(CacheGroup(PAGED, tuple(layers), layout, dtype, windowed))
    linear = config.linear_attention
    if config.linear_layers:
        state = CacheLayout(before_slots=(), per_slot=(depth, linear.state_width))
        groups.append(
            CacheGroup(RECURRENT, tuple(sorted(config.linear_layers)), state, state_dtype)
        )
    return tuple(groups)


def group_of(groups: tuple[CacheGroup, ...], kind: str) -> CacheGroup | None:
    """The first group of ``kind`` (a model has at most one recurrent group)."""
    return next((group for group in groups if group.kind == kind), None)


def bytes_per_block(
    groups: tuple[CacheGroup, ...], slots_per_block: int, windowed: bool | None = None
) -> int:
    """What one block costs: its slots in every paged group (0: no layer keeps KV);
    with ``windowed``, in the paged groups of that kind only."""
    return (
        sum(
            g.bytes_per_slot
            for g in groups
            if g.kind == PAGED and (windowed is None or g.windowed == windowed)
        )
        * slots_per_block
    )


def mixes_windows(groups: tuple[CacheGroup, ...]) -> bool:
    """Whether the paged groups come in both kinds, windowed and full."""
    kinds = {g.windowed for g in groups if g.kind == PAGED}
    return kinds == {True, False}


class CacheSizes(NamedTuple):
    num_blocks: int
    num_state_slots: int  # one per running request
    # States kept at cached prefixes' block boundaries, after the running slots
    # (``engine/prefix_states.py``).
    num_prefix_states: int = 0
    # Blocks of the windowed groups' own pool; 0: they share the full groups' blocks.
    num_window_blocks: int = 0


def split_budget(
    groups: tuple[CacheGroup, ...],
    budget_bytes: int,
    slots_per_block: int,
    max_num_seqs: int,
    prefix_states: int | None = 0,
    window_blocks_per_request: int | None = None,
) -> CacheSizes:
    """KV blocks and state slots out of one budget. Every running request holds a state
    slot, so up to ``max_num_seqs`` slots are kept, but at most half the budget goes to
    state slots: a request waits at admission for a free slot as it does for free
    blocks. ``prefix_states``: slots for prefix states besides, out of that half too;
    None: as many as the running slots. ``window_blocks_per_request``: the windowed
    groups have a pool of their own, of which a running request holds at most this many
    blocks (``window_pool_blocks``)."""
    recurrent = group_of(groups, RECURRENT)
    slots = prefixes = 0
    if recurrent is not None:
        half = budget_bytes // 2 // recurrent.bytes_per_slot
        if prefix_states is None:
            slots = prefixes = min(max_num_seqs, half // 2)
        else:
            slots, prefixes = min(max_num_seqs, half - prefix_states), prefix_states
        if slots < 1:
            raise ValueError(
                f"a KV cache budget of {budget_bytes / 2**30:.3f} GiB holds no recurrent-state "
                f"slot ({recurrent.bytes_per_slot} bytes each) beside {prefixes} prefix "
                "states: raise kv_cache_memory_gib or lower num_prefix_states"
            )
        budget_bytes -= (slots + prefixes) * recurrent.bytes_per_slot
    blocks = window_blocks = 0
    block_bytes = bytes_per_block(groups, slots_per_block)
    if block_bytes:
        blocks = budget_bytes // block_bytes
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib leaves {budget_bytes} bytes for KV blocks, which hold "
                f"no block ({block_bytes} bytes each)"
            )
        if window_blocks_per_request is not None:
            full = bytes_per_block(groups, slots_per_block, windowed=False)
            window = block_bytes - full
            blocks, window_blocks = window_pool_blocks(
                budget_bytes, full, window, max_num_seqs * window_blocks_per_request
            )
    return CacheSizes(blocks, slots, prefixes, window_blocks)


def window_pool_blocks(
    budget_bytes: int, full_bytes: int, window_bytes: int, window_cap: int
) -> tuple[int, int]:
    """(full blocks, windowed blocks) out of ``budget_bytes``, a block costing
    ``full_bytes`` in the full groups and ``window_bytes`` in the windowed ones. The
    windowed pool never needs more than ``window_cap`` blocks (every running request at
    its most) nor more than the full pool (a request holds no more windowed blocks than
    full ones); the full pool takes the rest. With a budget too small for the cap, both
    get the same count, as with one shared pool."""
    shared = budget_bytes // (full_bytes + window_bytes)
    if shared >= window_cap:
        return (budget_bytes - window_cap * window_bytes) // full_bytes, window_cap
    return shared, shared


def allocate_caches(
    groups: tuple[CacheGroup, ...],
    num_layers: int,
    sizes: CacheSizes,
    slots_per_block: int,
    device: torch.device | str,
    kv_sources: Sequence[int] = (),
) -> list[torch.Tensor]:
    """One cache tensor per decoder layer, in layer order, each with its spare slot.
    ``kv_sources``: per layer, the layer whose cache it reads (``ModelConfig.kv_source``;
    empty: each its own); a layer that reads another's is given that very tensor."""
    mark_phase("weights loaded")  # what came before the cache, for a memory report
    caches: list[torch.Tensor | None] = [None] * num_layers
    for group in groups:
        if group.kind == RECURRENT:
            count = sizes.num_state_slots + sizes.num_prefix_states
        elif group.windowed and sizes.num_window_blocks:
            count = sizes.num_window_blocks * slots_per_block
        else:
            count = sizes.num_blocks * slots_per_block
        shape = group.layout.shape(count + 1)
        try:
            for layer in group.layers:
                caches[layer] = allocate(shape, group.dtype, device)
        except (MemoryError, OSError, torch.OutOfMemoryError) as error:  # mmap: ENOMEM
            size = len(group.layers) * math.prod(shape) * group.dtype.itemsize / 2**30
            raise ValueError(
                f"cannot allocate a KV cache ({group.kind}: {count} slots, {size:.1f} GiB) on "
                f"{device}: {error}; lower kv_cache_memory_gib or num_kv_blocks"
            ) from error
    for layer, source in enumerate(kv_sources):
        if source != layer:
            caches[layer] = caches[source]
    mark_phase("KV cache allocated")
    return caches


def allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    if torch.device(device).type == "cpu":
        return zeros_on_first_write(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def live_slots(cache: torch.Tensor, group: CacheGroup) -> torch.Tensor:
    """``cache`` without its spare slot, which padded writes land in; an int8 cache's as
    the values its rows stand for (a scale's bytes are no measure of a difference)."""
    dim = group.layout.slot_dim
    live = cache.narrow(dim, 0, cache.shape[dim] - 1)
    return dequantize_rows(live) if cache.dtype == torch.int8 else live
