"""The KV block pool: allocation, reference counts and prefix caching of full blocks.

A block is ``block_size`` consecutive KV slots. Blocks whose tokens are all computed get
a key, a SHA-256 digest chained over the request's earlier blocks, so a later request
with the same prefix reuses them. The key must be collision-resistant: a prompt crafted
to collide with another user's prefix would otherwise read that user's KV. A free block
keeps its key (and its KV) until it is handed out again; free blocks are handed out
least recently freed first, which is LRU eviction of the prefix cache.

Where every layer that reads the cache (the target's, and a proposer's that pages
through the same block ids) has a sliding window, a running request's blocks that lie
wholly before the widest window are given back as the request goes on: its block table
keeps their ids, but no query reads them again.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from updraft.engine.prefix_states import PrefixStates
from updraft.request import Request

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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}  # content key -> block id
        # Free blocks in eviction order; an OrderedDict gives O(1) removal on a cache hit.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
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
            if self.ref_counts[block] == 0:
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
            cached = None
        if cached is None:
            self.cached[block_hash] = block
            self.block_hashes[block] = block_hash

    def _forget_hash(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block] = None


class KVCacheManager:
    """Per-request block bookkeeping on top of a ``BlockPool``."""

    def __init__(
        self,
        pool: BlockPool,
        salt: Callable[[Request], bytes] | None = None,
        window: int | None = None,
        prefix_states: PrefixStates | None = None,
    ) -> None:
        """``salt``: per request, what sets its blocks' keys apart from those of a request
        with the same tokens whose KV differs (nothing, for most models). ``window``: how
        far back any layer reading the cache looks (a query at position p reads no
        position before p - window + 1), when every such layer has a window.
        ``prefix_states``: a hybrid model's stored recurrent states, without which a
        cached prefix cannot be resumed (``prefix_states.py``)."""
        self.pool = pool
        self.block_size = pool.block_size
        self.salt = salt
        self.window = window
        self.prefix_states = prefix_states

    def cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the start of a request that holds no blocks yet. At
        least one token is always left to compute, because its logits are needed. A
        request that asks for its prompt's logprobs computes every prompt token. For a
        hybrid model, only a prefix whose last block has a stored state counts: the
        longest such."""
        if request.sampling_params.prompt_logprobs is not None:
            return []
        hashes = self._hashes(request, self.last_boundary(request) // self.block_size)
        blocks = self.pool.lookup(hashes)
        if self.prefix_states is not None:
            while blocks and hashes[len(blocks) - 1] not in self.prefix_states:
                blocks.pop()
        return blocks

    def last_boundary(self, request: Request) -> int:
        """The end of the request's last full block that ``cached_prefix`` could find:
        its last token is always left to compute."""
        return (request.num_tokens - 1) // self.block_size * self.block_size

    def block_key(self, request: Request, num_blocks: int) -> BlockKey:
        """The key of the request's block that ends at ``num_blocks`` blocks."""
        return self._hashes(request, num_blocks)[num_blocks - 1]

    def allocate(self, request: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens; with ``cached``, the request
        (which holds no blocks) first takes those blocks as its computed prefix. Returns
        False, changing nothing, when the pool is short."""
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        needed_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        new_blocks = needed_blocks - len(request.block_ids) - len(cached)
        revived = sum(1 for block in cached if self.pool.ref_counts[block] == 0)
        if new_blocks + revived > self.pool.num_free:
            return False
        if cached:
            self.pool.share(cached)
            request.block_ids = list(cached)
            request.num_computed_tokens = num_computed
            request.num_registered_blocks = len(cached)
        if new_blocks > 0:
            request.block_ids.extend(self.pool.allocate(new_blocks))
        return True

    def register_computed(self, request: Request) -> None:
        """Offer the request's newly completed full blocks to the prefix cache (only
        blocks whose tokens are all known: accepted drafts are appended after)."""
        computed = min(request.num_computed_tokens, request.num_tokens)
        full_blocks = computed // self.block_size
        if full_blocks <= request.num_registered_blocks:
            return
        hashes = self._hashes(request, full_blocks)
        for index in range(request.num_registered_blocks, full_blocks):
            self.pool.register(request.block_ids[index], hashes[index])
        request.num_registered_blocks = max(request.num_registered_blocks, full_blocks)

    def release_outside_window(self, request: Request) -> None:
        """Give back the request's blocks that no query reads again. Its next query is
        at position n (its computed tokens) or later, and reads from n - window + 1 on;
        one position of slack more (a block is released once it ends at or before
        n - window) spares a proposer that re-reads from the last computed token. Such
        blocks are full and registered already, so the prefix cache keeps them as
        evictable until they are handed out again."""
        if self.window is None:
            return
        dead = max(0, request.num_computed_tokens - self.window) // self.block_size
        dead = min(dead, request.num_registered_blocks, len(request.block_ids))
        if dead > request.num_released_blocks:
            self.pool.free(request.block_ids[request.num_released_blocks : dead][::-1])
            request.num_released_blocks = dead

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids[request.num_released_blocks :][::-1])
        request.block_ids = []
        request.num_registered_blocks = 0
        request.num_released_blocks = 0

    def _root(self, request: Request) -> BlockKey | None:
        """The parent key of the request's first block (None: the shared root)."""
        salt = b"" if self.salt is None else self.salt(request)
        return ROOT_KEY + salt if salt else None

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockKey]:
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else self._root(request)
            hashes.append(hash_block(parent, request.token_ids[index * size : (index + 1) * size]))
        return hashes[:num_blocks]
