"""Load a compiled kernel (built by ``updraft/c_builds.py``, once) into this process.

torch is imported before a kernel loads, so the kernel's ``libgomp.so.1`` resolves to
the OpenMP runtime torch already loaded (same soname): one thread pool for both.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch  # noqa: F401 (loads torch's OpenMP runtime first; see above)

from updraft.c_builds import built


@cache
def load(name: str, march: str = "native") -> ctypes.CDLL:
    """The compiled ``<name>.c``, built on first use. ``march``: the instructions to
    build for (another than the machine's own lets a test run a kernel's narrower
    paths: ``haswell`` for AVX2, ``x86-64`` for none)."""
    library = built(name, march)
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise RuntimeError(f"loading the {name} kernel failed: {error}") from error


@cache
def kernel_builds(name: str) -> bool:
    """Whether kernel ``name`` ("linear", "paged_attention", "token_mask", ...) builds and
    loads here (a C compiler is on PATH). Answered once per process: a failed build would
    otherwise be tried again by every caller."""
    try:
        load(name)
    except RuntimeError:
        return False
    return True
