"""A request's KV blocks: allocation, prefix-cache hits and blocks given back, on top
of the block pool (``block_pool.py``: reference counts, keys and eviction).

Where every layer that reads the cache (the target's, and a proposer's that pages
through the same block ids) has a sliding window, a running request's blocks that lie
wholly before the widest window are given back as the request goes on: its block table
keeps their ids, but no query reads them again. Where only some layers have one, those
layers' blocks are a pool of their own that gives back in the same way
(``window_blocks.py``), while the full layers keep every block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from updraft.engine.block_pool import ROOT_KEY, BlockKey, BlockPool, hash_block
from updraft.engine.prefix_states import PrefixStates
from updraft.engine.window_blocks import WindowBlocks
from updraft.request import Request

__all__ = ["ROOT_KEY", "BlockKey", "BlockPool", "KVCacheManager", "hash_block"]


class KVCacheManager:
    """Per-request block bookkeeping on top of a ``BlockPool``."""

    def __init__(
        self,
        pool: BlockPool,
        salt: Callable[[Request], bytes] | None = None,
        window: int | None = None,
        prefix_states: PrefixStates | None = None,
        windowed: WindowBlocks | None = None,
    ) -> None:
        """``salt``: per request, what sets its blocks' keys apart from those of a request
        with the same tokens whose KV differs (nothing, for most models). ``window``: how
        far back any layer reading the cache looks (a query at position p reads no
        position before p - window + 1), when every such layer has a window.
        ``prefix_states``: a hybrid model's stored recurrent states, without which a
        cached prefix cannot be resumed (``prefix_states.py``). ``windowed``: the
        windowed layers' own pool, in a model that mixes them with full layers; ``pool``
        is then the full layers'."""
        self.pool = pool
        self.block_size = pool.block_size
        self.salt = salt
        self.window = window
        self.prefix_states = prefix_states
        self.windowed = windowed

    def cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the start of a request that holds no blocks yet. At
        least one token is always left to compute, because its logits are needed. A
        request that asks for its prompt's logprobs computes every prompt token. For a
        hybrid model, only a prefix whose last block has a stored state counts, and for
        a model with a windowed pool only one whose windowed blocks that its next query
        reads are cached too: the longest such."""
        if request.sampling_params.prompt_logprobs is not None:
            return []
        hashes = self._hashes(request, self.last_boundary(request) // self.block_size)
        blocks = self.pool.lookup(hashes)
        while blocks and not self._resumable(hashes, len(blocks)):
            blocks.pop()
        return blocks

    def _resumable(self, hashes: list[BlockKey], num_blocks: int) -> bool:
        """Whether a cached prefix of ``num_blocks`` full blocks can be resumed: its
        recurrent state is stored (a hybrid model's), its windowed blocks are cached."""
        if self.prefix_states is not None and hashes[num_blocks - 1] not in self.prefix_states:
            return False
        return self.windowed is None or self.windowed.hit(hashes, num_blocks) is not None

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
        windowed = self.windowed
        window_cached: list[int] = []
        if windowed is not None:
            if cached:
                window_cached = windowed.hit(request.block_hashes, len(cached))
                if window_cached is None:  # cached_prefix checked it; nothing ran since
                    raise RuntimeError(f"request {request.request_id}: a stale prefix hit")
            if not windowed.room(max(new_blocks, 0), window_cached):
                return False
        if cached:
            self.pool.share(cached)
            request.block_ids = list(cached)
            request.num_computed_tokens = num_computed
            request.num_registered_blocks = len(cached)
            if windowed is not None:
                windowed.take_hit(request, len(cached), window_cached)
        if new_blocks > 0:
            request.block_ids.extend(self.pool.allocate(new_blocks))
            if windowed is not None:
                windowed.extend(request, new_blocks)
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
        if self.windowed is not None:
            first = request.num_registered_blocks
            self.windowed.register(request, first, hashes[first:full_blocks])
        request.num_registered_blocks = max(request.num_registered_blocks, full_blocks)

    def release_outside_window(self, request: Request) -> None:
        """Give back the request's blocks that no query reads again. Its next query is
        at position n (its computed tokens) or later, and reads from n - window + 1 on;
        one position of slack more (a block is released once it ends at or before
        n - window) spares a proposer that re-reads from the last computed token. Such
        blocks are full and registered already, so the prefix cache keeps them as
        evictable until they are handed out again. With a windowed pool, that pool's
        blocks go back so (``window_blocks.py``) and the full layers keep theirs."""
        if self.windowed is not None:
            self.windowed.release(request, request.num_registered_blocks)
        if self.window is None:
            return
        dead = max(0, request.num_computed_tokens - self.window) // self.block_size
        dead = min(dead, request.num_registered_blocks, len(request.block_ids))
        if dead > request.num_released_blocks:
            self.pool.free(request.block_ids[request.num_released_blocks : dead][::-1])
            request.num_released_blocks = dead

    def free(self, request: Request) -> None:
        if self.windowed is not None:
            self.windowed.free(request)
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
