"""Property tests: random streams of arrivals, aborts, finishes and speculative drafts
against the block pool and the scheduler never leak a block, free one twice, share one
wrongly, leave a draft or a planned token without its KV slot, or strand a request."""

from __future__ import annotations

import hashlib
import random
import struct
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from updraft.engine.kv_blocks import BlockPool, KVCacheManager, hash_block
from updraft.engine.scheduler import Scheduler
from updraft.engine.window_blocks import WindowBlocks
from updraft.request import FinishReason, Request
from updraft.sampling_params import SamplingParams
from updraft.step.output import StepOutput
from updraft.step.plan import Draft

BLOCK_SIZE = 4


def test_pool_allocates_frees_and_refuses_double_free():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE)
    blocks = pool.allocate(3)
    assert pool.num_free == 1 and len(set(blocks)) == 3
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks, 1 free"):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(blocks[:1])


def test_cached_block_is_reused_until_evicted_least_recently_freed_first():
    pool = BlockPool(num_blocks=3, block_size=BLOCK_SIZE)
    a, b, c = pool.allocate(3)
    pool.register(a, 111)
    pool.register(b, 222)
    pool.register(c, 333)
    pool.free([b, a, c])  # freed order b, a, c: b is evicted first
    assert pool.lookup([111, 222]) == [a, b]
    pool.share([a])
    assert pool.num_free == 2
    assert pool.allocate(1) == [b]  # b was the least recently freed
    assert pool.lookup([111, 222]) == [a]  # b's content is gone from the cache


def test_a_free_block_without_content_goes_first_and_cached_content_last():
    """On the CPU a cache's pages are resident once written: a freed block that caches
    nothing is handed out before one never touched, and a cached one only after both."""
    pool = BlockPool(num_blocks=6, block_size=BLOCK_SIZE)
    a, b, c = pool.allocate(3)
    pool.register(a, 111)
    pool.free([c, b, a])
    assert pool.num_free == 6 and [pool.is_free(block) for block in (a, b, c)] == [True] * 3
    assert pool.allocate(1) == [b]  # holds no key, the last freed of those
    assert pool.allocate(3) == [c, 3, 4]
    assert pool.lookup([111]) == [a]  # the cached block stays while others are left
    assert pool.allocate(2) == [5, a] and pool.lookup([111]) == []
    assert pool.num_free == 0 and not any(pool.is_free(block) for block in range(6))


def test_evicting_first_hands_out_cached_blocks_before_blocks_never_used():
    """--prefix-cache-evicts-first: the pool touches a block never used only when no
    freed one is left, cached or not."""
    pool = BlockPool(num_blocks=6, block_size=BLOCK_SIZE, evicts_first=True)
    a, b = pool.allocate(2)
    pool.register(a, 111)
    pool.register(b, 222)
    pool.free([b, a])
    assert pool.allocate(3) == [b, a, 2] and pool.lookup([111]) == []


def test_prefix_cache_hit_skips_computed_tokens():
    pool = BlockPool(num_blocks=8, block_size=BLOCK_SIZE)
    kv = KVCacheManager(pool)
    first = Request("a", None, list(range(10)), SamplingParams())
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.register_computed(first)
    second = Request("b", None, [*range(8), 99, 98, 97], SamplingParams())
    cached = kv.cached_prefix(second)
    assert cached == first.block_ids[:2]
    assert kv.allocate(second, 3, cached)
    assert second.num_computed_tokens == 8
    assert [pool.ref_counts[b] for b in cached] == [2, 2]


def test_block_keys_are_sha256_of_the_parent_key_and_the_token_ids():
    first = hash_block(None, [1, 2, 3, 4])
    assert first.hex() == "423c67495f85186ca3e591741ba6cc626e28672b9a607b1f2e4fb2b026dc3225"
    assert first == hashlib.sha256(b"updraft-kv-block" + struct.pack("<4q", 1, 2, 3, 4)).digest()
    second = hash_block(first, [5, 6, 7, 8])
    assert second == hashlib.sha256(first + struct.pack("<4q", 5, 6, 7, 8)).digest()
    assert hash_block(None, [5, 6, 7, 8]) != second  # the key covers the whole prefix


PI = [3, 1, 4, 1, 5, 9, 2, 6, 5]


@settings(max_examples=200, deadline=None)
@given(
    cut=st.integers(0, len(PI)),
    tail=st.lists(st.integers(0, 2**31), min_size=1, max_size=9),
)
def test_a_cached_prefix_is_found_only_by_the_same_tokens(cut, tail):
    pool = BlockPool(num_blocks=8, block_size=BLOCK_SIZE)
    kv = KVCacheManager(pool)
    owner = Request("owner", None, PI, SamplingParams())
    assert kv.allocate(owner, len(PI))
    owner.num_computed_tokens = len(PI)
    kv.register_computed(owner)
    other = PI[:cut] + tail
    found = kv.cached_prefix(Request("probe", None, other, SamplingParams()))
    # Full blocks of the probe (all but its last token) equal to the owner's, in order.
    usable = (len(other) - 1) // BLOCK_SIZE
    same = 0
    while same < min(usable, 2) and other[: (same + 1) * 4] == PI[: (same + 1) * 4]:
        same += 1
    assert found == owner.block_ids[:same]


class LateMasks:
    """Stands in for ``Grammars`` where the scheduler asks whether a request's mask
    missed the step: ``late`` names those whose mask did (the step keeps none of their
    tokens). No request here is constrained otherwise."""

    def __init__(self) -> None:
        self.late: set[str] = set()

    def is_late(self, request_id: str) -> bool:
        return request_id in self.late

    def waiting(self, request_id: str) -> bool:
        return False  # the late mask is ready by the next step

    def takes_drafts(self, request_id: str) -> bool:
        return True

    def __contains__(self, request_id: str) -> bool:
        return False

    def remove(self, request_id: str) -> None:
        self.late.discard(request_id)


class SchedulerMachine(RuleBasedStateMachine):
    """A scheduler driven by a fake model: each step 'samples' pseudo-random tokens and,
    with speculation, accepts a pseudo-random number of the drafts it proposed."""

    @initialize(
        num_blocks=st.integers(4, 24),
        max_num_seqs=st.integers(1, 6),
        token_budget=st.integers(1, 24),
        prefix_caching=st.booleans(),
        lookahead=st.integers(0, 3),
        window=st.sampled_from([None, None, 3, 9]),
        spare=st.integers(0, 8),
        late_masks=st.booleans(),
    )
    def setup(
        self,
        num_blocks,
        max_num_seqs,
        token_budget,
        prefix_caching,
        lookahead,
        window,
        spare,
        late_masks,
    ):
        """With a ``window``, a model whose windowed layers have a pool of their own:
        at least what one request can hold in it, or as many blocks as the full pool.
        With ``late_masks``, some sampled requests' masks miss their step, drafts and
        all."""
        self.pool = BlockPool(num_blocks, BLOCK_SIZE, prefix_caching)
        self.window_pool, windowed = None, None
        if window is not None:
            most = -(-(window + token_budget + lookahead) // BLOCK_SIZE) + 2
            self.window_pool = BlockPool(min(num_blocks, most + spare), BLOCK_SIZE, prefix_caching)
            windowed = WindowBlocks(self.window_pool, window)
        self.window = window
        self.capacity = num_blocks * BLOCK_SIZE
        self.scheduler = Scheduler(
            KVCacheManager(self.pool, windowed=windowed),
            max_num_seqs,
            token_budget,
            self.capacity,
            lookahead,
            grammars=LateMasks() if late_masks else None,
        )
        self.drafts: dict[str, Draft] = {}
        self.all_requests: list[Request] = []
        self.rng = random.Random(0)
        self.next_id = 0

    @rule(
        # A small alphabet and shared heads make prefix-cache hits common.
        head=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=12),
        max_tokens=st.integers(1, 10),
    )
    def add(self, head, tail, max_tokens):
        prompt = (head + tail)[: self.capacity - 1]
        request = Request(str(self.next_id), None, prompt, SamplingParams(max_tokens=max_tokens))
        self.next_id += 1
        self.all_requests.append(request)
        self.scheduler.add(request)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish(self.scheduler.requests[request_id], FinishReason.ABORT)

    @rule()
    def step(self):
        scheduler = self.scheduler
        plan = scheduler.schedule(self.drafts)
        if scheduler.requests:
            assert plan.scheduled or scheduler.running, "work exists but nothing ran"
        assert plan.num_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        sampled, tokens, accepted = [], [], []
        for item in plan.scheduled:
            request = item.request
            assert item.num_new_tokens >= 1
            assert item.num_drafts <= item.num_new_tokens - 1
            end = request.num_computed_tokens + item.num_new_tokens
            assert end <= len(request.block_ids) * BLOCK_SIZE, "a planned token has no slot"
            assert request.num_tokens + item.num_drafts <= self.capacity
            if item.samples:
                num_accepted = self.rng.randint(0, item.num_drafts)
                sampled.append(request.request_id)
                accepted.append(num_accepted)
                tokens.append(
                    [*item.draft.token_ids[:num_accepted], self.rng.randrange(4)]
                    if item.draft
                    else [self.rng.randrange(4)]
                )
        output = StepOutput(sampled, tokens, accepted, None, None, 0.0, "fake")
        late_masks = scheduler.grammars
        if late_masks is not None:
            late_masks.late = {r for r in sampled if self.rng.random() < 0.3}
        for result in scheduler.update(plan, output):
            request_id = result.request_id
            assert result.finished == (request_id not in scheduler.requests)
        if late_masks is not None:
            late_masks.late = set()
        # A proposer writes KV for each draft position from the last token on: those
        # slots must already be reserved.
        self.drafts = {}
        for request, limit in scheduler.drafting():
            assert limit >= 1
            assert request.num_tokens - 1 + limit <= len(request.block_ids) * BLOCK_SIZE
            count = self.rng.randint(0, limit)
            self.drafts[request.request_id] = Draft([self.rng.randrange(4) for _ in range(count)])

    @invariant()
    def finished_requests_stopped_where_they_had_to(self):
        if not hasattr(self, "pool"):
            return
        for request in self.all_requests:
            if request.finish_reason is FinishReason.LENGTH:
                limit = min(
                    request.num_prompt_tokens + request.sampling_params.max_tokens, self.capacity
                )
                assert request.num_tokens == limit

    def _pools(self):
        """(pool, each request's held blocks by index) of every pool."""
        requests = self.scheduler.requests.values()
        pools = [(self.pool, [dict(enumerate(r.block_ids)) for r in requests])]
        if self.window_pool is not None:
            held = [
                {i: b for i, b in enumerate(r.window_block_ids) if i >= r.num_window_released}
                for r in requests
            ]
            pools.append((self.window_pool, held))
        return pools

    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "pool"):
            return
        for request in self.scheduler.requests.values():
            if self.window_pool is not None:
                assert len(request.window_block_ids) == len(request.block_ids)
        for pool, held in self._pools():
            holders = Counter()
            for blocks in held:
                assert len(set(blocks.values())) == len(blocks)
                holders.update(blocks.values())
            for block in range(pool.num_blocks):
                assert pool.ref_counts[block] == holders[block]
                assert pool.is_free(block) == (holders[block] == 0)

    @invariant()
    def only_identical_content_is_shared(self):
        if not hasattr(self, "pool"):
            return
        requests = list(self.scheduler.requests.values())
        for pool, held in self._pools():
            owners: dict[int, int] = {}
            for request, blocks in zip(requests, held, strict=True):
                for index, block in blocks.items():
                    if pool.ref_counts[block] > 1:
                        # A shared block is a cached one, at a position whose content
                        # hash (which chains over all earlier tokens) is the block's.
                        assert pool.block_hashes[block] is not None
                        assert request.block_hashes[index] == pool.block_hashes[block]
                        assert owners.setdefault(block, index) == index

    @invariant()
    def every_window_reads_held_blocks(self):
        """A running request holds every windowed block from the one its next query's
        window starts in (position n - window + 1) on."""
        if getattr(self, "window_pool", None) is None:
            return
        for request in self.scheduler.running:
            first = max(0, request.num_computed_tokens - self.window + 1) // BLOCK_SIZE
            assert request.num_window_released <= first

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for _ in range(10_000):
            if not self.scheduler.requests:
                break
            self.step()
        assert not self.scheduler.requests, "a request never finished"
        assert all(r.finished for r in self.all_requests)
        for pool, _ in self._pools():
            assert pool.num_free == pool.num_blocks
            assert all(count == 0 for count in pool.ref_counts)
        if self.scheduler.num_lookahead_tokens:
            assert self.scheduler.speculative.rounds >= 0


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
