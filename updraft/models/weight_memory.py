"""Where a loaded model's weights live, as a user chooses (``--no-mmap``, ``--mlock``,
as llama.cpp offers them).

By default a weight the kernels read as the checkpoint stores it stays in the file's
memory map: its pages are the page cache's, read in as they are touched and shared with
any other process mapping the file. ``--no-mmap`` reads each such weight into memory of
the process's own (the file's map is then closed), so nothing is read from the disk once
the engine has started, at the cost of a private copy. ``--mlock`` locks every weight's
pages, mapped or not, in memory, so the OS never pages them out under pressure; the
process's RLIMIT_MEMLOCK must allow it (``ulimit -l``), and a refusal is an error that
names the limit.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from dataclasses import dataclass

import torch
from torch import nn

from updraft.resident import PAGE, mappings

MADV_DONTNEED = 4  # madvise(2): drop the pages; a file's come back from the page cache
# A mapped weight smaller than this is copied out of the map even with mmap: reading a
# few bytes of a file maps the page cache's whole folio around them, up to 2 MiB where
# the file system keeps large folios (ext4, xfs), so a 500M model's 97 norms, 0.3 MiB
# in all, held 64 MiB of the file resident.
SMALL_MAPPED_BYTES = 2 << 20
# The most of a file one read maps in (a large folio, on ext4 or xfs).
FOLIO_BYTES = 2 << 20


@dataclass(frozen=True)
class WeightMemory:
    mmap: bool = True  # False: read mapped weights into the process's memory
    mlock: bool = False  # lock the weights' pages in memory


def settle_weights(model: nn.Module, memory: WeightMemory) -> None:
    """Apply ``memory`` to a loaded model's weights (its parameters and buffers)."""
    if memory.mmap:
        read_into_memory(model, below=SMALL_MAPPED_BYTES)
        release_unkept_pages(model)
    else:
        read_into_memory(model)
    if memory.mlock:
        lock_in_memory(model)


def _storages(model: nn.Module) -> dict[int, list[torch.Tensor]]:
    """The model's CPU tensors, by the address of the storage they view."""
    found: dict[int, list[torch.Tensor]] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        plain = tensor.layout == torch.strided and not tensor.is_mkldnn  # not oneDNN's
        if plain and tensor.device.type == "cpu" and not tensor.is_meta and tensor.numel():
            found.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    return found


def read_into_memory(model: nn.Module, below: int | None = None) -> int:
    """Copy every weight that views a file's memory map (whose storage is smaller than
    ``below``, if given) into memory of its own, with the same sizes, strides and
    offsets -> bytes copied. With ``below``, the map's pages each copy read (a whole
    folio around it) are dropped as it is made, where no weight left in the map lies:
    a 500M model's few dozen small weights otherwise held 113 MiB of the file at once."""
    files = [(m.start, m.end) for m in mappings() if m.file_backed]
    storages = _storages(model)

    def mapped(address: int) -> bool:
        return any(start <= address < end for start, end in files)

    kept = [  # the weights left in a map, whose pages no drop may touch
        extent(tensor)
        for address, tensors in storages.items()
        if below is not None and mapped(address) and tensors[0].untyped_storage().nbytes() >= below
        for tensor in tensors
    ]
    copied = 0
    with torch.no_grad():
        for address, tensors in storages.items():
            old = tensors[0].untyped_storage()
            small = below is None or old.nbytes() < below
            if not small or not mapped(address):
                continue
            new = torch.empty(old.nbytes(), dtype=torch.uint8).untyped_storage()
            new.copy_(old)
            for tensor in tensors:
                tensor.set_(
                    new, tensor.storage_offset(), tensor.shape, tensor.stride()
                )  # every holder of the tensor sees the copy
            copied += old.nbytes()
            if below is not None:
                _drop_around(address, address + old.nbytes(), kept, files)
    return copied


def _drop_around(
    start: int, end: int, kept: list[tuple[int, int]], files: list[tuple[int, int]]
) -> None:
    """Drop the pages of the map [start, end) lies in, within the 2 MiB around it (the
    largest folio a read maps), but those of ``kept`` extents. Only that map's: a
    neighbouring one may be a library's, whose written pages would be lost."""
    low, high = start // FOLIO_BYTES * FOLIO_BYTES, -(-end // FOLIO_BYTES) * FOLIO_BYTES
    first, last = next((a, b) for a, b in files if a <= start < b)
    low, high = max(low, first), min(high, last)
    cursor = low
    for a, b in [*sorted((a, b) for a, b in kept if a < high and low < b), (high, high)]:
        drop_pages(cursor, min(a, high))
        cursor = max(cursor, b)


def release_unkept_pages(model: nn.Module) -> int:
    """Drop from this process the pages of a weight file's map that no weight views:
    loading read every tensor there (most of them into another layout), and a page read
    stays resident while the map lives, which one weight kept in place makes it do.
    They come back from the page cache if read again. -> bytes dropped."""
    libc = ctypes.CDLL(None, use_errno=True)
    kept = [extent(t) for tensors in _storages(model).values() for t in tensors]
    dropped = 0
    for mapping in mappings():
        inside = sorted((a, b) for a, b in kept if mapping.start <= a < mapping.end)
        if not mapping.file_backed or not inside or not mapping.rss:
            continue
        low = mapping.start
        for start, end in [*inside, (mapping.end, mapping.end)]:
            dropped += drop_pages(low, start, libc)
            low = max(low, end)
    return dropped


def drop_pages(start: int, end: int, libc: ctypes.CDLL | None = None) -> int:
    """``MADV_DONTNEED`` the whole pages in [start, end) -> bytes dropped (0 if none lie
    there, or the OS refused)."""
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last <= first:
        return 0
    libc = libc or ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED):
        return 0
    return last - first


def extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses [first, last) a tensor's elements lie between."""
    span = sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.data_ptr(), tensor.data_ptr() + (span + 1) * tensor.element_size()


def lock_in_memory(model: nn.Module) -> int:
    """``mlock`` the pages of every weight -> bytes locked; a ``ValueError`` naming
    RLIMIT_MEMLOCK (and the bytes asked for) when the OS refuses."""
    ranges = []
    for tensors in _storages(model).values():
        storage = tensors[0].untyped_storage()
        start = storage.data_ptr() // PAGE * PAGE
        ranges.append((start, storage.data_ptr() + storage.nbytes() - start))
    wanted = sum(length for _, length in ranges)
    for start, length in ranges:
        code = _mlock(start, length)
        if code:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            raise ValueError(
                f"--mlock: the OS refused to lock the weights' {wanted / 2**20:.1f} MiB "
                f"({errno.errorcode.get(code, code)}: {os.strerror(code)}); RLIMIT_MEMLOCK "
                f"is {limit}: raise it (ulimit -l, or memlock in "
                "/etc/security/limits.conf) or run without --mlock"
            )
    return wanted


def _mlock(start: int, length: int) -> int:
    """``mlock(2)`` -> 0, or the errno it failed with."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlock(ctypes.c_void_p(start), ctypes.c_size_t(length)) == 0:
        return 0
    return ctypes.get_errno()
