"""Weights in 2 MiB pages (``kernels/huge_pages.py``): cut from slabs the kernel may back
with transparent huge pages, each on a cache line, and gone with the last weight."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_gguf import random_blocks
from updraft.kernels.gguf_ops import BLOCK_TYPES, gguf_group, gguf_ungroup
from updraft.kernels.huge_pages import ALIGN, HUGE_PAGE, SLAB_BYTES, huge_page_empty
from updraft.resident import mappings

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int):
    return next((m for m in mappings() if m.start <= address < m.end), None)


def _smaps_field(start: int, field: str) -> str | None:
    """``field`` of the /proc/self/smaps entry that starts at ``start``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith(f"{start:x}-"):
            for entry in lines[index + 1 :]:
                if entry.startswith(f"{field}:"):
                    return entry.split()[1]
                if "-" in entry.split(None, 1)[0] and not entry.split(None, 1)[0].endswith(":"):
                    return None
    return None


def test_weights_are_cut_from_advised_slabs_on_cache_lines():
    if not Path("/proc/self/smaps").exists():
        pytest.skip("reads /proc/self/smaps (Linux)")
    first = huge_page_empty(3, 1000)
    second = huge_page_empty(5000, dtype=torch.float32)
    assert first.shape == (3, 1000) and second.dtype == torch.float32
    assert first.is_contiguous() and second.is_contiguous()
    assert first.data_ptr() % ALIGN == 0 and second.data_ptr() % ALIGN == 0
    slab = _mapping_of(first.data_ptr())
    assert slab is not None and not slab.file_backed
    if _mapping_of(second.data_ptr()).start == slab.start:  # one slab, carved in turn
        assert second.data_ptr() == first.data_ptr() + -(-3000 // ALIGN) * ALIGN
    if THP.exists() and "[never]" not in THP.read_text():
        assert _smaps_field(slab.start, "THPeligible") == "1"
    second.fill_(1.0)
    first.fill_(7)
    assert (second == 1.0).all() and (first == 7).all()  # no overlap


def test_a_slab_goes_with_its_last_weight():
    if not Path("/proc/self/smaps").exists():
        pytest.skip("reads /proc/self/smaps (Linux)")
    large = huge_page_empty(SLAB_BYTES + 1)  # a slab of its own, never touched
    start = _mapping_of(large.data_ptr()).start
    assert large.data_ptr() % HUGE_PAGE == 0 and large.data_ptr() - start < HUGE_PAGE
    view = large[10:20]
    del large
    gc.collect()
    assert _mapping_of(view.data_ptr()) is not None  # a view holds it
    del view
    gc.collect()
    assert all(m.start != start for m in mappings())


def test_groups_in_huge_pages_give_back_the_file_s_bytes():
    k, n = 2048, 8 * 300 + 5  # more than a huge page of groups
    blocks = torch.from_numpy(random_blocks("Q4_K", n, k, np.random.default_rng(0)))
    groups = gguf_group(blocks, BLOCK_TYPES["Q4_K"], k)
    assert groups.numel() > HUGE_PAGE
    rows = torch.tensor([0, n // 2, n - 1])
    assert torch.equal(gguf_ungroup(groups, BLOCK_TYPES["Q4_K"], k, n, rows), blocks[rows])
