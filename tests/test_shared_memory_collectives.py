"""The shared-memory collectives of one machine's ranks, with two ranks as two threads
(the flags' spin-wait runs without the GIL) and a slot small enough to force chunks."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from updraft.parallel.shared_memory import SharedMemoryGroup


@pytest.fixture
def ranks():
    name = f"updraft-test-{os.getpid()}"
    groups = [SharedMemoryGroup(name, 0, 2, create=True, capacity=256)]
    groups.append(SharedMemoryGroup(name, 1, 2, create=False, capacity=256))
    yield groups
    for group in reversed(groups):
        group.close()


def on_both(ranks, work):
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(work, ranks))


# float32 takes the C path (kernels/shm_barrier.c), other dtypes the Python one
# (bfloat16 summed in float32 and rounded once, as torch adds two bfloat16 tensors).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_all_reduce_sums_in_chunks_and_every_rank_gets_the_same_bits(ranks, dtype):
    torch.manual_seed(0)
    for scale in (1, 2, 3):  # reused slots hold nothing stale
        # 7 x 50 values: 6 or 11 exchanges of 256 bytes
        parts = [scale * torch.randn(7, 50, dtype=dtype), torch.randn(7, 50, dtype=dtype)]
        results = on_both(ranks, lambda g, parts=parts: g.all_reduce(parts[g.rank]))
        torch.testing.assert_close(results[0], parts[0] + parts[1])
        assert torch.equal(results[0], results[1])


def test_all_gather_last_concatenates_in_rank_order(ranks):
    parts = [torch.arange(60.0).view(3, 20), -torch.arange(60.0).view(3, 20)]
    results = on_both(ranks, lambda g: g.all_gather_last(parts[g.rank]))
    for result in results:
        assert torch.equal(result, torch.cat(parts, dim=-1))


def test_broadcast_object_of_any_size(ranks):
    for value in (None, {"tokens": [1, 2, 3]}, {"big": list(range(1000)), "t": torch.arange(9)}):
        results = on_both(ranks, lambda g, v=value: g.broadcast_object(v if g.rank == 0 else None))
        assert repr(results[1]) == repr(value)


def _attach_and_exit(name: str) -> None:
    SharedMemoryGroup(name, 1, 2, create=False, capacity=256).memory.close()


def test_a_rank_that_exited_is_named_instead_of_waited_for_forever():
    name = f"updraft-test-exit-{os.getpid()}"
    group = SharedMemoryGroup(name, 0, 2, create=True, capacity=256)
    try:
        peer = multiprocessing.get_context("spawn").Process(target=_attach_and_exit, args=(name,))
        peer.start()
        peer.join()  # exited before ever arriving
        with pytest.raises(RuntimeError, match="rank 1 of the parallel group exited"):
            group.all_reduce(torch.ones(4))
    finally:
        group.close()


def test_a_region_left_by_a_killed_process_is_replaced():
    name = f"updraft-test-stale-{os.getpid()}"
    stale = SharedMemoryGroup(name, 0, 2, create=True, capacity=256)
    stale.memory.close()  # never unlinked, as after a kill
    fresh = SharedMemoryGroup(name, 0, 2, create=True, capacity=256)
    fresh.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rank_alive_but_stuck_is_named_after_the_step_timeout(ranks, dtype):
    """Rank 1's process lives (it is this one) but never arrives: rank 0's in-step
    collective gives up after its limit and names it, through the C and Python waits;
    the group is broken from then on."""
    ranks[0].step_timeout_ms = 300
    stuck = r"rank 1 of the parallel group has not arrived within 0\.3 s"
    with pytest.raises(RuntimeError, match=stuck):
        ranks[0].all_reduce(torch.ones(4, dtype=dtype))
