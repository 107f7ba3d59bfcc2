"""Threads that work beside the steps (an API process's grammar compiles; the engine's
grammars run in a process of their own, ``engine/grammar_worker.py``) run at a lower
priority than the steps' own, and their CPU time counts as another process's in the
thread budget (``runner/threads.py``), so the forward leaves them a core while they are
busy. The lower priority matters where other processes keep the machine busy too: the
OS then serves the steps first, and a flood of costly grammars slows the requests that
carry them, not every stream. Under 1,000 hostile requests on 2 cores an unrelated
stream kept 0.35-0.39x of its solo speed with these threads at the steps' priority,
0.71-0.94x at 10 nice values below it and 0.83-1.04x at 19 (``bench_hostile``, three and
four runs). Counted as the engine's own instead, the forward's two threads shared their
cores with them: 0.65-1.05x, with the stream's largest gap 211-326 ms against 70-196.

An API process compiles grammars in such threads too, and never loads torch.
"""

from __future__ import annotations

import os
import sys
import threading

# How much lower than the steps' threads these run, in nice values: 19 is the lowest,
# about 1.5% of a contended core against a step's thread (10 lower got about a tenth).
# They still run whenever a core is free, between steps and while the engine waits.
LOWER_BY = 19

# Native ids of this process's threads whose CPU time counts as another process's.
SIDE_THREADS: set[int] = set()


def lower_priority() -> None:
    """Called in a thread that works beside the steps (a thread pool's initializer): it
    runs at the lower priority from then on (Linux only, where a thread's nice value is
    its own), and the cores it keeps busy are left to it, as to another process."""
    native_id = threading.get_native_id()
    SIDE_THREADS.add(native_id)
    if not sys.platform.startswith("linux"):
        return
    try:
        priority = os.getpriority(os.PRIO_PROCESS, 0) + LOWER_BY
        os.setpriority(os.PRIO_PROCESS, native_id, priority)
    except OSError:  # a sandbox that forbids it: the thread keeps the process's priority
        pass
