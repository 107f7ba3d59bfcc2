"""The block pool: allocation, reference counts and prefix caching of full blocks.

A block is ``block_size`` consecutive KV slots. Blocks whose tokens are all computed get
a key, a SHA-256 digest chained over the request's earlier blocks, so a later request
with the same prefix reuses them. The key must be collision-resistant: a prompt crafted
to collide with another user's prefix would otherwise read that user's KV. A free block
keeps its key (and its KV) until it is handed out again; free blocks are handed out
least recently freed first, which is LRU eviction of the prefix cache.

A free block that holds no key (a request's last, partial block; every block without
prefix caching) is handed out before any other, the most recently freed first: it
caches nothing, and on the CPU its pages are resident already, where a block never
handed out has pages that only its first write brings in. Blocks never handed out come
next, and blocks with cached content last, so the cache loses nothing to this order.
With ``evicts_first`` (``--prefix-cache-evicts-first``) cached blocks come before those
never handed out: the resident cache then grows only with the most blocks requests
hold at once, not with every prompt seen (a 1 GiB budget was wholly resident after
three rounds of 32 cold prompts on a 500M model), at the cost of fewer cached prefixes.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockKey = bytes
ROOT_KEY = b"updraft-kv-block"  # the parent of a sequence's first block


def hash_block(parent_key: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
    """SHA-256 of the parent block's key and the token ids as little-endian int64."""
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    parent = ROOT_KEY if parent_key is None else parent_key
    return hashlib.sha256(parent + tokens.tobytes()).digest()


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        evicts_first: bool = False,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.evicts_first = evicts_first  # cached blocks before those never handed out
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}  # content key -> block id
        # Free blocks with cached content in eviction order; an OrderedDict gives O(1)
        # removal on a cache hit.
        self.free_blocks: OrderedDict[int, None] = OrderedDict()
        self.empty_blocks: dict[int, None] = {}  # free without a key, most recent last
        self.next_fresh = 0  # blocks from here on were never handed out

    @property
    def num_free(self) -> int:
        fresh = self.num_blocks - self.next_fresh
        return len(self.free_blocks) + len(self.empty_blocks) + fresh

    def is_free(self, block: int) -> bool:
        return block >= self.next_fresh or block in self.empty_blocks or block in self.free_blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            fresh = self.next_fresh < self.num_blocks
            if self.empty_blocks:
                block, _ = self.empty_blocks.popitem()
            elif fresh and not (self.evicts_first and self.free_blocks):
                block, self.next_fresh = self.next_fresh, self.next_fresh + 1
            else:
                block, _ = self.free_blocks.popitem(last=False)
            self._forget_hash(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. Pass a request's blocks tail first, so its
        last blocks (least likely to be shared) are evicted first."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"KV block {block} freed twice")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0 and self.block_hashes[block] is None:
                self.empty_blocks[block] = None
            elif self.ref_counts[block] == 0:
                self.free_blocks[block] = None

    def lookup(self, block_hashes: Sequence[BlockKey]) -> list[int]:
        """The cached blocks for the longest prefix of ``block_hashes``."""
        blocks = []
        if self.enable_prefix_caching:
            for block_hash in block_hashes:
                block = self.cached.get(block_hash)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def lookup_each(self, block_hashes: Sequence[BlockKey]) -> list[int | None]:
        """The cached block of each key, or None where it is not cached."""
        if not self.enable_prefix_caching:
            return [None] * len(block_hashes)
        return [self.cached.get(block_hash) for block_hash in block_hashes]

    def share(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks found by ``lookup``."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1

    def register(self, block: int, block_hash: BlockKey) -> None:
        """Record a block's content once all its tokens are computed. The first block
        with given content stays the cached one while a request holds it; a free one
        (next to be evicted) hands the content's key to this one, so that a prefix
        computed again (a hybrid model's whose state was gone) stays findable whole."""
        if not self.enable_prefix_caching or self.block_hashes[block] is not None:
            return
        cached = self.cached.get(block_hash)
        if cached is not None and self.ref_counts[cached] == 0:
            self._forget_hash(cached)
            del self.free_blocks[cached]
            self.empty_blocks[cached] = None
            cached = None
        if cached is None:
            self.cached[block_hash] = block
            self.block_hashes[block] = block_hash

    def _forget_hash(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block] = None
