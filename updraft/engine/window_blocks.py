"""The windowed layers' own block pool, in a model that mixes windowed and full layers.

Gemma 3 (five layers in six), gpt-oss (every other layer) and Qwen2 with
``max_window_layers`` have layers whose query at position p reads no position before
p - window + 1, beside layers that read every position. When one block id named a slot
range in every layer's cache, no block could go back while the request ran: the full
layers still read it. Here the windowed layers' caches have blocks of their own: a
request holds one windowed block per full block (``Request.window_block_ids``, the same
positions, so the windowed block table has the same columns as the full one), and gives
back those its widest window has passed after each step, as an all-windowed model does
with its only pool (``KVCacheManager.release_outside_window``). Their ids stay in the
table; no query reads them again (the kernel starts past them, the gathered mask hides
them).

**The prefix cache.** A windowed block is registered under the same key as the full
block of the same positions, and stays cached, evictable, once it is given back. A
prefix of n blocks is resumed at position n * block_size, whose query reads windowed
blocks from ``first_needed(n * block_size)`` on only, so a hit is limited to the longest
prefix that both kinds still hold where it is read: every full block, and the windowed
blocks that the window of its first computed token reaches. The windowed blocks before
those are never taken (their table entries are 0, never read, never freed): a hit does
not need the windowed layers' whole prefix kept, and a long cached prompt then costs
the windowed pool only its last window.
"""

from __future__ import annotations

from collections.abc import Sequence

from updraft.engine.block_pool import BlockKey, BlockPool
from updraft.request import Request


class WindowBlocks:
    """Per-request bookkeeping of the windowed kind's blocks in their own ``pool``;
    ``window``: the widest window of the layers that keep KV there."""

    def __init__(self, pool: BlockPool, window: int) -> None:
        self.pool = pool
        self.window = window
        self.block_size = pool.block_size

    def first_needed(self, num_computed: int) -> int:
        """The first block a request with ``num_computed`` tokens in the cache still
        reads: its next query is at position ``num_computed`` or later and reads from
        ``num_computed - window + 1`` on. (No slack for a proposer that re-reads the
        last token, as an all-windowed model keeps: a model with a proposer of its own
        keeps no windowed pool.)"""
        return max(0, num_computed - self.window + 1) // self.block_size

    def hit(self, hashes: Sequence[BlockKey], num_blocks: int) -> list[int] | None:
        """The windowed blocks a prefix hit of ``num_blocks`` blocks reads (those from
        ``first_needed`` on), or None when one of them is no longer cached."""
        first = self.first_needed(num_blocks * self.block_size)
        blocks = self.pool.lookup_each(hashes[first:num_blocks])
        return None if None in blocks else blocks

    def room(self, new_blocks: int, cached: Sequence[int]) -> bool:
        """Whether ``new_blocks`` more blocks, and the cached ones taken first, fit."""
        revived = sum(1 for block in cached if self.pool.ref_counts[block] == 0)
        return new_blocks + revived <= self.pool.num_free

    def take_hit(self, request: Request, num_blocks: int, cached: Sequence[int]) -> None:
        """A request admitted on a prefix hit of ``num_blocks`` blocks takes the
        windowed ones it reads (``cached``, from ``hit``); the others stay untaken."""
        first = num_blocks - len(cached)
        self.pool.share(cached)
        request.window_block_ids = [0] * first + list(cached)
        request.num_window_released = first

    def extend(self, request: Request, new_blocks: int) -> None:
        request.window_block_ids.extend(self.pool.allocate(new_blocks))

    def register(self, request: Request, first: int, hashes: Sequence[BlockKey]) -> None:
        """Offer the request's windowed blocks ``first ..`` (those of ``hashes``, the
        keys from block ``first`` on) to the prefix cache, beside the full ones."""
        for index, key in enumerate(hashes, start=first):
            if index >= request.num_window_released:
                self.pool.register(request.window_block_ids[index], key)

    def release(self, request: Request, num_registered: int) -> None:
        """Give back the windowed blocks no query of the request reads again (only
        registered ones: a block given back keeps its content findable)."""
        dead = min(self.first_needed(request.num_computed_tokens), num_registered)
        if dead > request.num_window_released:
            held = request.window_block_ids[request.num_window_released : dead]
            self.pool.free(held[::-1])
            request.num_window_released = dead

    def free(self, request: Request) -> None:
        self.pool.free(request.window_block_ids[request.num_window_released :][::-1])
        request.window_block_ids = []
        request.num_window_released = 0
