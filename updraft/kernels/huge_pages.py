"""Memory in 2 MiB pages for the weights a decode step streams.

A batch-1 decode step reads every weight once, straight from memory: a 500M model's
Q8_0 groups are 700 MB, some 170,000 pages of 4 KiB. Each new page costs a TLB miss
and a page walk, and a core's hardware prefetchers stop at every page's end, so a
thread's stream stalls where the page changes. Transparent huge pages (2 MiB, which
Linux gives a range advised ``MADV_HUGEPAGE`` in its default ``madvise`` mode) take
both away (``benchmarks/bench_decode_pass.py`` measures a decode step's linears on
either).

Weights are cut from slabs: each an anonymous map advised ``MADV_HUGEPAGE`` before any
page is touched, carved front to back from a 2 MiB boundary, each weight on a cache
line. A weight's tensor views its slab, which lives while any of them does (a model's
weights go with it: the slab being carved is only weakly held here). What a slab holds
past its last weight is never touched, so it takes no memory beyond the rest of that
weight's last huge page. Where transparent huge pages are off (or on another OS) the
advice is refused and the pages stay small, with nothing else changed.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import weakref

import torch

HUGE_PAGE = 2 << 20
SLAB_BYTES = 64 << 20  # a slab's size, or a larger weight's own
ALIGN = 64  # a cache line: each weight starts on one


def _advise_huge(buffer: mmap.mmap) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(buffer, "madvise"):
        return
    with contextlib.suppress(OSError):  # no transparent huge pages here: small pages it is
        buffer.madvise(advice)


class _Slab:
    """An advised map, held weakly, and how much of it is handed out."""

    def __init__(self, size: int) -> None:
        # private: shared anonymous memory is shmem, whose huge pages are off by default
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        buffer = mmap.mmap(-1, size + HUGE_PAGE, flags=flags)  # a page more, for a boundary
        _advise_huge(buffer)
        self.buffer = weakref.ref(buffer)
        self.used = -torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
        self.end = self.used + size
        self.first = buffer  # held until its first weight holds it

    def take(self, nbytes: int) -> torch.Tensor | None:
        buffer, self.first = self.buffer(), None
        if buffer is None or self.used + nbytes > self.end:
            return None
        out = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=self.used)
        self.used += -(-nbytes // ALIGN) * ALIGN
        return out

    @property
    def room(self) -> int:
        return 0 if self.buffer() is None else self.end - self.used


_lock = threading.Lock()
_carving: _Slab | None = None


def huge_page_empty(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` in memory advised into huge pages,
    for a weight every decode step reads."""
    global _carving
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(*shape, dtype=dtype)
    with _lock:
        taken = None if _carving is None else _carving.take(nbytes)
        if taken is None:
            slab = _Slab(max(SLAB_BYTES, -(-nbytes // HUGE_PAGE) * HUGE_PAGE))
            taken = slab.take(nbytes)
            if _carving is None or slab.room > _carving.room:  # carve on where most is left
                _carving = slab
    assert taken is not None
    return taken.view(dtype).view(*shape)
