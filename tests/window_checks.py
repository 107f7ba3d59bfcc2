"""What a sliding window needs of the block pools, checked after every step.

After a step, a running request with n tokens in the cache next queries position n (or
later), and a layer with window W reads positions n - W + 1 .. n. So every block that
holds one of those positions, and every block the request will still write (positions
n and on), must be held by it: taken from its pool and not handed back, so that no
other request can be given it. A block the request will still write is its alone
(reference count 1): a shared block is a cached prefix's, full and read-only.

The windows come from the model's config, not from the code under test, so a release
rule that gives one block back too early fails here at the first step it does so,
whatever the size of the pool (a pool large enough never reuses a block, so the tokens
alone would not show it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from updraft import LLM, SamplingParams
from updraft.attention.cache_groups import bytes_per_block, cache_groups
from updraft.engine.block_pool import BlockPool
from updraft.model_config import ModelConfig
from updraft.outputs import RequestOutput


def assert_windows_held(llm: LLM) -> int:
    """Check every running request's blocks after a step; returns the requests checked."""
    engine = llm.engine
    kv = engine._scheduler.kv  # noqa: SLF001 (the blocks are what is checked)
    windows = engine.model_config.layer_windows or (None,)
    widest = max((w for w in windows if w is not None), default=None)
    # Which pool each kind of layer reads, with the window it reads back.
    if kv.windowed is not None:
        kinds = [("full", kv.pool, None), ("window", kv.windowed.pool, widest)]
    else:  # one pool: every layer's window, or none where one layer reads everything
        kinds = [("shared", kv.pool, None if None in windows else widest)]
    running = engine._scheduler.running  # noqa: SLF001
    for request in running:
        computed = request.num_computed_tokens
        for kind, pool, window in kinds:
            blocks = request.window_block_ids if kind == "window" else request.block_ids
            first_read = 0 if window is None else max(0, computed - window + 1)
            first = first_read // pool.block_size
            _assert_held(pool, blocks[first:], f"{request.request_id} {kind} from block {first}")
            writable = blocks[computed // pool.block_size :]
            shared = [block for block in writable if pool.ref_counts[block] != 1]
            assert not shared, f"{request.request_id} {kind}: blocks it writes are shared: {shared}"
    return len(running)


def _assert_held(pool: BlockPool, blocks: list[int], where: str) -> None:
    free = [block for block in blocks if pool.ref_counts[block] < 1 or pool.is_free(block)]
    assert not free, f"{where}: blocks a window still reads are back in the pool: {free}"


def run_checked(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> list[RequestOutput]:
    """Generate step by step, checking the blocks after each step; each prompt's last
    output, in order."""
    engine = llm.engine
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    last: dict[str, RequestOutput] = {}
    checked = 0
    while engine.has_unfinished:
        for output in engine.step():
            last[output.request_id] = output
        checked += assert_windows_held(llm)
    assert checked, "no step had a running request to check"
    return [last[request_id] for request_id in ids]


def budget_gib(directory: Path, full_blocks: int, window_blocks: int, block_size: int = 4) -> float:
    """A KV budget of ``full_blocks`` full-layer blocks and ``window_blocks`` windowed
    ones (half a block more, against rounding)."""
    groups = cache_groups(ModelConfig.from_dir(directory), torch.float32)
    full = bytes_per_block(groups, block_size, windowed=False)
    window = bytes_per_block(groups, block_size, windowed=True)
    return (full_blocks * full + window_blocks * window + full // 2) / 2**30
