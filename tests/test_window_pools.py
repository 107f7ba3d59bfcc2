"""Per-kind block pools: in a model that mixes sliding-window and full-attention layers
(tiny Gemma 3: layers 0 and 2 windowed, 1 and 3 full), the windowed layers' blocks go
back to their own pool once every window has passed them, while the full layers keep
theirs; the tokens equal those of one shared pool (and so transformers', which
tests/test_sliding_window.py compares the default, pooled, engine against), eagerly and
with FULL graphs, whose replays read each step's windowed table; a prefix hit is limited
to what both kinds still hold; and every window's blocks are held at every step
(``tests/window_checks.py``), so a release one block too early fails whatever the pool's
size.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import WINDOW, build_checkpoint
from tests.helpers import greedy, token_ids
from tests.probes import assert_idle, count_prefix_hits, logits_of, probed, records
from tests.window_checks import assert_windows_held, budget_gib, run_checked
from updraft import LLM
from updraft.attention.cache_groups import window_pool_blocks
from updraft.engine.block_pool import BlockPool
from updraft.engine.kv_blocks import KVCacheManager
from updraft.engine.window_blocks import WindowBlocks
from updraft.request import Request
from updraft.sampling_params import SamplingParams

BLOCK = 4
PROMPTS = [list(range(3, 40)), [7, 8, 9] * 10, list(range(100, 125))]
PARAMS = [greedy(40) for _ in PROMPTS]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_checkpoint("gemma3", tmp_path_factory.mktemp("pools-gemma3"))


ARGS = dict(block_size=BLOCK, max_num_seqs=3, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def shared_pool(gemma3):
    """The tokens and logits of one pool for every layer (nothing given back)."""
    llm = probed(gemma3, **ARGS, num_kv_blocks=128, kv_pools_per_kind=False, enforce_eager=True)
    assert llm.engine.stats().window_blocks_total == 0
    outputs = llm.generate(PROMPTS, PARAMS)
    seen = records(llm)
    return token_ids(outputs), [logits_of(seen, output) for output in outputs]


def test_sliding_layers_blocks_return_to_their_pool_while_full_layers_keep_theirs(gemma3):
    llm = LLM(
        gemma3, block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False, enforce_eager=True
    )
    engine = llm.engine
    engine.add_request(list(range(3, 30)), greedy(40))
    held = []
    while engine.has_unfinished:
        engine.step()
        assert_windows_held(llm)
        stats = engine.stats()
        held.append((stats.kv_blocks_used, stats.window_blocks_used))
    full, windowed = zip(*held, strict=True)
    # The full layers hold a block per 4 positions of the 66 in the cache; the windowed
    # layers at most their window's 8 positions, one position of slack and a block in
    # progress, however long the request runs.
    assert max(full) == -(-66 // BLOCK)
    assert max(windowed[1:]) <= WINDOW // BLOCK + 2, windowed
    assert_idle(llm)


@pytest.mark.parametrize(
    "mode",
    [{"enforce_eager": True}, {"graph_mode": "full"}, {"graph_mode": "piecewise"}],
    ids=["eager", "full", "piecewise"],
)
def test_logits_equal_one_shared_pool_when_given_back_blocks_are_reused(gemma3, shared_pool, mode):
    """A budget that gives the windowed layers only what 3 running requests can hold
    (3 x (8 + 16) / 4 + 2 blocks), so their blocks go round the requests while the full
    pool is roomy: the two kinds' ids part, and a step that read or wrote a windowed
    layer through the full table, or a stale windowed one, would change logits (the
    tiny model's greedy tokens may not show it). PIECEWISE graphs re-run attention as
    tasks with each step's metadata; FULL ones hold it."""
    llm = probed(gemma3, **ARGS, kv_cache_memory_gib=budget_gib(gemma3, 100, 24), **mode)
    stats = llm.engine.stats()
    assert (stats.kv_blocks_total, stats.window_blocks_total) == (100, 24)
    parted = []
    original_step = llm.engine.step

    def step():
        outputs = original_step()
        running = llm.engine._scheduler.running  # noqa: SLF001
        parted.extend(r.block_ids[-1] != r.window_block_ids[-1] for r in running)
        return outputs

    llm.engine.step = step
    outputs = run_checked(llm, PROMPTS, PARAMS)
    assert any(parted)
    replayed = any(step.startswith("graph") for step in llm.engine.stats().steps)
    assert replayed == ("graph_mode" in mode)
    assert_idle(llm)
    tokens, logits = shared_pool
    assert token_ids(outputs) == tokens
    seen = records(llm)
    for output, expected in zip(outputs, logits, strict=True):
        torch.testing.assert_close(logits_of(seen, output), expected, atol=1e-4, rtol=0)


def test_a_prefix_hit_reads_the_windowed_blocks_it_needs_and_equals_a_fresh_run(
    gemma3, monkeypatch
):
    shared = list(range(3, 40))
    prompts = [[*shared, 50 + i] for i in range(2)]
    args = dict(block_size=BLOCK, num_kv_blocks=64, enforce_eager=True)
    fresh = token_ids(
        LLM(gemma3, **args, enable_prefix_caching=False).generate(prompts, greedy(20))
    )
    hits = count_prefix_hits(monkeypatch)
    llm = LLM(gemma3, **args)
    served = [token_ids(run_checked(llm, [p], [greedy(20)]))[0] for p in prompts]
    assert served == fresh
    assert hits == [0, len(shared) // BLOCK], hits


def _request(name: str, tokens: list[int]) -> Request:
    return Request(name, None, tokens, SamplingParams())


def _computed(kv: KVCacheManager, request: Request, count: int) -> None:
    """``count`` more of the request's tokens computed, as a step ends them."""
    assert kv.allocate(request, count)
    request.num_computed_tokens += count
    kv.register_computed(request)
    kv.release_outside_window(request)


def test_a_hit_stops_where_the_windowed_blocks_it_reads_were_evicted():
    """The full pool still holds every block of a finished prompt; the windowed pool
    only its last window's, and then not even those once another request took them."""
    window = 8
    kv = KVCacheManager(BlockPool(32, BLOCK), windowed=WindowBlocks(BlockPool(16, BLOCK), window))
    prompt = list(range(1, 34))  # 8 full blocks and one token
    first = _request("a", prompt)
    for _ in range(0, 33, 8):
        _computed(kv, first, min(8, 33 - first.num_computed_tokens))
    # Its windowed blocks before the last window went back while it ran.
    assert first.num_window_released == (33 - window) // BLOCK
    kv.free(first)
    again = _request("b", [*prompt[:32], 99])
    assert len(kv.cached_prefix(again)) == 8  # the windowed blocks 6, 7 are still cached
    assert kv.allocate(again, 1, kv.cached_prefix(again))
    assert again.num_window_released == 6 and again.window_block_ids[:6] == [0] * 6
    kv.free(again)
    # Another request takes every windowed block (evicting the cached ones) while the
    # full pool keeps the prompt's.
    other = _request("c", list(range(500, 564)))
    assert kv.allocate(other, 64)
    assert kv.windowed.pool.num_free == 0 and kv.pool.num_free == 16
    third = _request("d", [*prompt[:32], 98])
    hit = kv.cached_prefix(third)
    assert len(kv.pool.lookup(third.block_hashes[:8])) == 8  # the full layers' are there
    assert hit == [], hit  # but no windowed tail that a resumed query would read


def test_the_windowed_pool_is_sized_to_what_running_requests_can_hold():
    """A block costs 5 bytes in the full layers and 5 in the windowed ones, and running
    requests hold at most 12 windowed blocks in all: the windowed pool gets those 12,
    the full pool the rest; a budget too small for them splits evenly, as one shared
    pool would."""
    assert window_pool_blocks(1000, 5, 5, 12) == (188, 12)
    assert window_pool_blocks(100, 5, 5, 12) == (10, 10)


# -- mutations: a window's blocks given back too early ---------------------------------


def _one_block_early(monkeypatch) -> None:
    """Every release rule, the shared pool's and the windowed pool's, reaches one block
    further than the window allows."""
    release = KVCacheManager.release_outside_window
    first_needed = WindowBlocks.first_needed

    def early(self, request):
        if self.window is not None:
            self.window -= self.block_size
        try:
            release(self, request)
        finally:
            if self.window is not None:
                self.window += self.block_size

    monkeypatch.setattr(KVCacheManager, "release_outside_window", early)
    monkeypatch.setattr(
        WindowBlocks, "first_needed", lambda self, n: first_needed(self, n + self.block_size)
    )


@pytest.mark.parametrize("num_kv_blocks", [24, 96, 512])
def test_a_block_given_back_one_block_early_fails_for_any_pool_size(
    gemma3, monkeypatch, num_kv_blocks
):
    _one_block_early(monkeypatch)
    llm = LLM(gemma3, block_size=BLOCK, num_kv_blocks=num_kv_blocks, enforce_eager=True)
    with pytest.raises(AssertionError, match="a window still reads"):
        run_checked(llm, PROMPTS[:1], [greedy(30)])
