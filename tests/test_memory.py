"""A KV budget is reserved, not paid up front: on the CPU the cache's pages are mapped
as blocks fill, so a large budget costs little memory until it is used."""

from __future__ import annotations

import gc
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
    """Also for engines made one after another in a process that keeps freed memory:
    a cache taken from memory malloc hands out again would be written over with zeros,
    every page of it mapped up front."""
    params = greedy(8)
    for _ in range(3):
        gc.collect()
        before = resident_bytes()
        llm = LLM(tiny_llama, kv_cache_memory_gib=0.75, keep_freed_memory=True)
        assert llm.engine.stats().kv_blocks_total * 16 > 750_000  # 384 MiB a layer, kept when freed
        first = llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
        assert resident_bytes() - before < 256 * 2**20
        del llm
    # Unwritten slots read as zeros: the same prompt in a fresh, small cache agrees.
    assert (
        LLM(tiny_llama, num_kv_blocks=16).generate([[1, 2, 3]], params)[0].outputs[0].token_ids
        == first
    )


FAULTS_OF_STEPS = """
import resource, sys, torch
from updraft import LLM
from updraft.demo import DEMO_MODEL_DIR

LLM(str(DEMO_MODEL_DIR), enforce_eager=True, keep_freed_memory=sys.argv[1] == "keep")

def faults_of_steps(steps: int) -> int:
    # one 40 MiB temporary a step: above the largest mmap threshold glibc sets itself
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        torch.empty(10 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_steps(16)  # the heap grows to where a freed block fits the next (alignment)
print(faults_of_steps(8))
"""


@pytest.mark.parametrize("setting", ["keep", "return"])
def test_memory_a_step_frees_is_kept_for_the_next_not_faulted_in_again(setting):
    """In a process of its own, since malloc's settings are the process's: once an
    engine is loaded, a step's large temporary reuses the pages the last one freed;
    with --no-keep-freed-memory each is faulted in afresh, page by page."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", FAULTS_OF_STEPS, setting],
        capture_output=True,
        text=True,
        check=True,
    )
    faults = int(result.stdout.split()[-1])
    if setting == "keep":
        assert faults < 1_000, faults
    else:
        assert faults > 8 * 10_000, faults  # 10,240 4-KiB pages each
