"""Keep the memory a step frees for the next step, rather than handing it back to the OS.

An eager step (a long prefill chunk) allocates a fresh tensor per op, megabytes each.
glibc's malloc serves allocations above its mmap threshold (128 KiB, rising to at most
32 MiB as large blocks are freed) with a mapping of their own, unmapped when freed, and
gives the freed top of its heap back past its trim threshold. Either way the next step's
tensors land on pages the kernel must fault in and zero one by one: a cold prefill of
32 prompts on the 100M checkpoint took 225,000-580,000 page faults. With both thresholds
at 1 GiB the same prefill takes under a few thousand and runs 1.19x faster on two cores
(``benchmarks/bench_freed_memory.py``). KV caches are mapped on their own whatever
their size (``attention/cache_layout.py``), so none is carved from kept memory.

The cost is that memory a step once needed stays in the process (its high-water mark)
instead of going back after the step. The engine calls this once its weights are
loaded and its graphs captured, after handing back what loading freed.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30


def keep_freed_memory(keep_bytes: int = KEEP_BYTES) -> bool:
    """Set glibc malloc's mmap and trim thresholds to ``keep_bytes``, after trimming
    what is free now. False, changing nothing, where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    malloc_trim = getattr(libc, "malloc_trim", None)
    if mallopt is None or malloc_trim is None:  # not glibc (musl has no malloc_trim)
        return False
    malloc_trim(0)
    return bool(mallopt(M_MMAP_THRESHOLD, keep_bytes)) and bool(
        mallopt(M_TRIM_THRESHOLD, keep_bytes)
    )
