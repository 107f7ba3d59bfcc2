"""What of this process is resident, and where: its mappings (``/proc/self/smaps``),
the resident pages of given anonymous address ranges (``mincore``; of a file's pages it
tells the page cache's state, not this process's), the pages glibc malloc holds free,
what an import costs, and the start-up's phases with the peak each reached.

Linux only; each reader returns nothing (or zero) elsewhere, so a report built from them
shows zeros rather than fail. The phase marks reset the kernel's peak (VmHWM) only
while ``recording_phases`` is on, so the peak an outside measure reads is never touched
unless a memory report asked for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

PAGE = mmap.PAGESIZE
MIB = 2**20


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/self/smaps``: [start, end), its file ('' if anonymous or a
    kernel name such as ``[heap]``), resident and anonymous bytes."""

    start: int
    end: int
    path: str
    rss: int
    anonymous: int

    @property
    def file_backed(self) -> bool:
        return self.path.startswith("/") and not self.path.startswith("/dev/zero")


def mappings() -> list[Mapping]:
    """This process's mappings, from ``/proc/self/smaps`` (empty where there is none)."""
    try:
        text = open("/proc/self/smaps").read()  # noqa: SIM115 - read in one go
    except OSError:
        return []
    found: list[Mapping] = []
    head: tuple[int, int, str] | None = None
    fields: dict[str, int] = {}

    def close() -> None:
        if head is not None:
            found.append(Mapping(*head, fields.get("Rss", 0), fields.get("Anonymous", 0)))

    for line in text.splitlines():
        first = line.split(None, 1)[0] if line else ""
        if "-" in first and not first.endswith(":"):
            close()
            parts = line.split(None, 5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            head, fields = (start, end, parts[5].strip() if len(parts) > 5 else ""), {}
        elif first.endswith(":") and line.endswith("kB"):
            fields[first[:-1]] = int(line.split()[1]) * 1024
    close()
    return found


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes; 0 if none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak() -> bool:
    """Start the kernel's peak (VmHWM) again from the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def resident_pages(ranges: Iterable[tuple[int, int]]) -> np.ndarray:
    """The page numbers, sorted and distinct, of the resident pages in the address
    ranges [start, end) (``mincore``: a page is resident if it is in memory now)."""
    libc = _libc()
    found = []
    for start, end in ranges:
        first, last = start // PAGE, -(-end // PAGE)
        if last <= first or libc is None:
            continue
        vector = (ctypes.c_ubyte * (last - first))()
        if libc.mincore(ctypes.c_void_p(first * PAGE), (last - first) * PAGE, vector) != 0:
            continue  # a range not mapped (a view of nothing): nothing resident
        flags = np.frombuffer(vector, dtype=np.uint8)
        found.append(first + np.flatnonzero(flags & 1))
    if not found:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(found))


def give_back_free_memory() -> int:
    """Hand the pages glibc malloc holds free back to the OS (``malloc_trim``) -> the
    resident bytes that freed: the allocator's slack, measured by removing it. 0 where
    the C library is not glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return 0
    before = status_bytes("VmRSS")
    libc.malloc_trim(0)
    return max(0, before - status_bytes("VmRSS"))


def _libc() -> ctypes.CDLL | None:
    if not os.path.exists("/proc/self/smaps"):
        return None
    return ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class ImportBaseline:
    """RSS with the interpreter alone, and once torch is imported: taken by the caller
    before anything else is loaded (``measure``)."""

    interpreter: int
    torch_import: int

    @classmethod
    def measure(cls) -> ImportBaseline:
        before = status_bytes("VmRSS")
        import torch  # noqa: F401 - what importing it costs is the measure

        return cls(before, status_bytes("VmRSS"))


def import_cost(modules: tuple[str, ...]) -> int:
    """What importing ``modules`` adds to the RSS of a fresh interpreter that has
    imported torch: measured in a child process, since in this one they are loaded
    already, wherever from. 0 if the child fails."""
    import subprocess
    import sys

    code = (
        "import importlib, sys, torch\nfrom updraft.resident import status_bytes\n"
        "before = status_bytes('VmRSS')\n"
        "for name in sys.argv[1:]:\n    importlib.import_module(name)\n"
        "print(status_bytes('VmRSS') - before)"
    )
    done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True)
    return int(done.stdout) if done.returncode == 0 and done.stdout.strip().isdigit() else 0


@dataclass(frozen=True)
class Phase:
    """A stretch of start-up: RSS at its end and the most it reached during it."""

    name: str
    rss: int
    peak: int


class PhaseLog:
    """The phases marked while recording (``mark_phase``), in order."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []
        self.start_rss = status_bytes("VmRSS")
        reset_peak()

    def mark(self, name: str) -> None:
        self.phases.append(Phase(name, status_bytes("VmRSS"), status_bytes("VmHWM")))
        reset_peak()


_recording: list[PhaseLog] = []


@contextlib.contextmanager
def recording_phases() -> Iterator[PhaseLog]:
    """Log the phases marked inside (each one's end RSS and peak): the kernel's peak is
    reset at every mark, so read VmHWM before entering if it matters."""
    log = PhaseLog()
    _recording.append(log)
    try:
        yield log
    finally:
        _recording.remove(log)


def mark_phase(name: str) -> None:
    """End a phase of start-up (loading the weights, the KV cache, capturing), for a
    memory report that is recording; nothing otherwise."""
    for log in _recording:
        log.mark(name)
