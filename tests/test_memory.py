"""A KV budget is reserved, not paid up front: on the CPU the cache's pages are mapped
as blocks fill, so a large budget costs little memory until it is used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import greedy
from updraft import LLM

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc"
)


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_kv_budget_costs_memory_only_as_blocks_fill(tiny_llama):
    before = resident_bytes()
    llm = LLM(tiny_llama, kv_cache_memory_gib=2.0)
    assert llm.engine.stats().kv_blocks_total * 16 > 1_000_000  # a cache of 2 GiB
    params = greedy(8)
    first = llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    assert resident_bytes() - before < 256 * 2**20
    # Unwritten slots read as zeros: the same prompt in a fresh, small cache agrees.
    assert (
        LLM(tiny_llama, num_kv_blocks=16).generate([[1, 2, 3]], params)[0].outputs[0].token_ids
        == first
    )
