"""How many KV blocks, state slots and windowed blocks a runner's caches hold, and so
how many positions its model's tables need: the cache bounds every sequence, so a model
is never built for more positions than its cache holds, whatever
``max_position_embeddings`` says.

``num_kv_blocks`` blocks (and a state slot per running request) where it is set, else
what ``kv_cache_memory_gib`` holds (``cache_groups.split_budget``). A hybrid model with
prefix caching also keeps ``num_prefix_states`` prefix states (by default as many as
its running slots). A model whose windowed layers keep a pool of their own
(``keeps_window_pool``) gets as many windowed blocks as blocks where ``num_kv_blocks``
is set, else what its running requests can hold at most, the full pool the rest.
"""

from __future__ import annotations

import torch

from updraft.attention.cache_groups import (
    PAGED,
    CacheGroup,
    CacheSizes,
    cache_groups,
    group_of,
    mixes_windows,
    split_budget,
)
from updraft.config import EngineConfig
from updraft.model_config import ModelConfig
from updraft.models.tensor_parallel import local_config
from updraft.parallel.topology import ParallelSizes, RankPlace


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
        local_config(model_config, sizes), *config.cache_dtypes(dtype), max(query_lens)
    )


def keeps_window_pool(
    model_config: ModelConfig, config: EngineConfig, name: str, place: RankPlace | None
) -> bool:
    """Whether a model's windowed layers keep their KV in a pool of their own: a target
    that mixes windowed and full layers, unless ``kv_pools_per_kind`` is off, a proposer
    with a model of its own pages through (or reads) the target's block ids, or a prefill
    split over ranks (whose gathered writes carry the full layers' slots only)."""
    if not config.kv_pools_per_kind or name != "target":
        return False
    if config.speculative_method not in (None, "ngram"):
        return False
    if place is not None and place.sizes.prefill_context > 1:
        return False
    return mixes_windows(cache_groups(model_config, torch.float32))


def runner_cache_sizes(
    groups: tuple[CacheGroup, ...],
    model_config: ModelConfig,
    config: EngineConfig,
    max_model_len: int,
    window_pool: bool,
    query_len: int,
) -> CacheSizes:
    """The sizes of a runner's caches; ``query_len``: its longest query (a verify
    step's)."""
    hybrid = bool(model_config.linear_layers)
    prefixes = config.num_prefix_states if hybrid and config.enable_prefix_caching else 0
    if config.num_kv_blocks is not None:
        slots = config.max_num_seqs if hybrid else 0
        window_blocks = config.num_kv_blocks if window_pool else 0
        return CacheSizes(
            config.num_kv_blocks, slots, slots if prefixes is None else prefixes, window_blocks
        )
    budget = int(config.kv_cache_memory_gib * 2**30)
    per_request = (
        window_blocks_per_request(model_config, config, query_len) if window_pool else None
    )
    sizes = split_budget(
        groups,
        budget,
        config.block_size,
        config.max_num_seqs,
        prefixes,
        window_blocks_per_request=per_request,
    )
    if group_of(groups, PAGED) is None:
        # No layer keeps KV: blocks cost nothing but still count positions, so every
        # running request may reach the context length.
        per_request = -(-max_model_len // config.positions_per_block)
        sizes = sizes._replace(num_blocks=config.max_num_seqs * per_request)
    return sizes


def window_blocks_per_request(
    model_config: ModelConfig, config: EngineConfig, query_len: int
) -> int:
    """The most windowed blocks a running request holds: those its widest window still
    reads (given back only after a step), then a step's tokens at most, and the drafts'
    lookahead of a verify step (``query_len - 1``)."""
    window = max(w for w in model_config.layer_windows if w is not None)
    reach = window + config.max_num_batched_tokens + query_len - 1
    return -(-reach // config.positions_per_block) + 2


def positions_held(
    config: EngineConfig,
    model_config: ModelConfig,
    groups: tuple[CacheGroup, ...],
    max_model_len: int,
    num_blocks: int | None = None,
) -> int:
    """The longest sequence a runner can hold: ``max_model_len``, or fewer where its KV
    blocks (``num_blocks``, a proposer's given by the target; else its own, counted as if
    one pool held every kind, which holds at least as many) hold fewer."""
    if group_of(groups, PAGED) is None:
        return max_model_len
    if num_blocks is None:
        sizes = runner_cache_sizes(groups, model_config, config, max_model_len, False, 1)
        num_blocks = sizes.num_blocks
    return min(max_model_len, num_blocks * config.positions_per_block)
