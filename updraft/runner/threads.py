"""How many CPU threads a step's kernels use, given what else the machine runs.

Matrix kernels split each op evenly over their threads and wait for the slowest. When
another process keeps a core busy, the thread that shares that core runs at half speed
or less, in scheduler time slices of milliseconds, and every op waits for it: on two
cores one busy neighbour made decode 3-4x slower with two threads, where one thread on
the free core loses only the second core's share. So the engine watches the CPU time
other processes take (``/proc/stat`` minus its own ``/proc/self/stat``) and leaves them
the cores they use, taking every core back once they go quiet; the engine's grammar
process is one of them. Threads of the engine's own process that work beside the
steps run at a lower priority and register in ``runner/side_threads.py``: their CPU
time counts as another process's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from updraft.runner.side_threads import SIDE_THREADS

CHECK_EVERY_SECONDS = 0.5
BUSY_CORE = 0.5  # others' use, in cores, from which a core counts as taken


def _machine_busy_ticks() -> int | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
    values = [int(v) for v in fields[1:9]]
    return sum(values) - values[3] - values[4]


def _ticks(stat_path: str) -> int | None:
    try:
        stat = Path(stat_path).read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime + stime


def _own_ticks() -> int | None:
    """The CPU time of this process, less that of the threads counted as others'."""
    own = _ticks("/proc/self/stat")
    if own is None:
        return None
    for thread in list(SIDE_THREADS):
        ticks = _ticks(f"/proc/self/task/{thread}/stat")
        if ticks is None:  # the thread has ended
            SIDE_THREADS.discard(thread)
        else:
            own -= ticks
    return own


class ThreadBudget:
    """Sets torch's thread count before a step: all cores, less those other processes
    have kept busy over the last half second. A no-op where ``/proc`` is missing or
    the user fixed the count (``OMP_NUM_THREADS``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.cores = torch.get_num_threads()
        self.enabled = (
            enabled
            and self.cores > 1
            and "OMP_NUM_THREADS" not in os.environ
            and _machine_busy_ticks() is not None
            and _own_ticks() is not None
        )
        self.threads = self.cores
        self._ticks_per_second = os.sysconf("SC_CLK_TCK") if self.enabled else 100
        self._last = (time.monotonic(), _machine_busy_ticks(), _own_ticks())

    def others_cores(self) -> float | None:
        """Cores other processes used since the last call; None until enough time passed."""
        now = time.monotonic()
        last_time, last_busy, last_own = self._last
        if now - last_time < CHECK_EVERY_SECONDS:
            return None
        busy, own = _machine_busy_ticks(), _own_ticks()
        self._last = (now, busy, own)
        if busy is None or own is None or last_busy is None or last_own is None:
            return None
        return (
            max(0.0, (busy - last_busy) - (own - last_own))
            / self._ticks_per_second
            / (now - last_time)
        )

    def adjust(self) -> int:
        """Call before a step; returns the thread count the step runs with."""
        if not self.enabled:
            return self.threads
        others = self.others_cores()
        if others is not None:
            taken = max(1, round(others)) if others >= BUSY_CORE else 0
            threads = max(1, self.cores - taken)
            if threads != self.threads:
                torch.set_num_threads(threads)
                self.threads = threads
        return self.threads
