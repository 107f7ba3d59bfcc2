"""Run a piece of code in this process within a time and memory bound.

The hostile-input tests load hundreds of broken files and configs; a subprocess each
would cost seconds of imports per case, so each runs here, under:

* a timer that raises ``TimeoutError`` in the main thread at the time bound (a loop over
  a count a header made up is Python code, which the signal interrupts);
* the address space capped a little above the memory bound, so an allocation a header
  asked for fails at once instead of paging the machine to death;
* the peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs`` before the
  case) compared with the bound afterwards.
"""

from __future__ import annotations

import resource
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from updraft.resident import reset_peak, status_bytes

MIB = 2**20


def _status(name: str) -> int:
    """A /proc/self/status field in bytes; a bound that read zeros would hold nothing."""
    value = status_bytes(name)
    if not value:
        raise LookupError(f"/proc/self/status has no {name}")
    return value


@dataclass
class Spent:
    seconds: float = 0.0
    peak_mib: float = 0.0  # the resident peak above what was resident before


def _on_alarm(signum, frame) -> None:
    raise TimeoutError("the time bound ran out")


@contextmanager
def bounded(seconds: float, mib: int) -> Iterator[Spent]:
    """Yields a ``Spent`` filled in on exit; raises ``TimeoutError`` past ``seconds``
    and ``MemoryError`` (from whatever allocates) far past ``mib``."""
    spent = Spent()
    if not reset_peak():  # VmHWM := VmRSS
        raise OSError("/proc/self/clear_refs cannot be written: no peak to bound")
    before = _status("VmRSS")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _status("VmSize") + 8 * mib * MIB  # room for arenas and stacks
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.perf_counter()
    try:
        yield spent
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        spent.seconds = time.perf_counter() - start
        spent.peak_mib = (_status("VmHWM") - before) / MIB
