"""How many KV blocks and state slots a runner keeps, and so how many positions its
model's tables need: the cache bounds every sequence, so a model is never built for
more positions than its cache holds, whatever ``max_position_embeddings`` says."""

from __future__ import annotations

import torch

from updraft.attention.cache_groups import (
    PAGED,
    CacheGroup,
    CacheSizes,
    cache_groups,
    group_of,
    split_budget,
)
from updraft.config import EngineConfig
from updraft.model_config import ModelConfig
from updraft.models.tensor_parallel import local_config
from updraft.parallel.topology import ParallelSizes


def runner_cache_groups(
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    sizes: ParallelSizes,
    query_lens: tuple[int, ...],
) -> tuple[CacheGroup, ...]:
    """The cache groups of a runner of this rank (a verify step leaves the state after
    each of its tokens: 1 + k rows per slot)."""
    return cache_groups(
        local_config(model_config, sizes), dtype, config.state_dtype, max(query_lens)
    )


def kv_cache_sizes(
    config: EngineConfig,
    model_config: ModelConfig,
    groups: tuple[CacheGroup, ...],
    max_model_len: int,
) -> CacheSizes:
    """KV blocks and state slots: ``num_kv_blocks`` blocks (and a slot per running
    request) where it is set, else what ``kv_cache_memory_gib`` holds. A hybrid model
    with prefix caching also keeps ``num_prefix_states`` prefix states (by default as
    many as its running slots)."""
    hybrid = bool(model_config.linear_layers)
    prefixes = config.num_prefix_states if hybrid and config.enable_prefix_caching else 0
    if config.num_kv_blocks is not None:
        slots = config.max_num_seqs if hybrid else 0
        return CacheSizes(config.num_kv_blocks, slots, slots if prefixes is None else prefixes)
    budget = int(config.kv_cache_memory_gib * 2**30)
    sizes = split_budget(groups, budget, config.block_size, config.max_num_seqs, prefixes)
    if group_of(groups, PAGED) is None:
        # No layer keeps KV: blocks cost nothing but still count positions, so every
        # running request may reach the context length.
        per_request = -(-max_model_len // config.positions_per_block)
        sizes = sizes._replace(num_blocks=config.max_num_seqs * per_request)
    return sizes


def positions_held(
    config: EngineConfig,
    model_config: ModelConfig,
    groups: tuple[CacheGroup, ...],
    max_model_len: int,
    num_blocks: int | None = None,
) -> int:
    """The longest sequence a runner can hold: ``max_model_len``, or fewer where its KV
    blocks (``num_blocks``, a proposer's given by the target; else its own) hold fewer."""
    if group_of(groups, PAGED) is None:
        return max_model_len
    if num_blocks is None:
        num_blocks = kv_cache_sizes(config, model_config, groups, max_model_len).num_blocks
    return min(max_model_len, num_blocks * config.positions_per_block)
