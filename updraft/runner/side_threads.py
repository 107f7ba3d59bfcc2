"""Threads that work beside the steps (grammar compiles and masks) run at a lower
priority than the steps' own: on a busy machine the OS gives the forward's threads the
cores first, and grammar work takes what they leave. So a flood of costly grammars
slows the requests that carry them, not every stream: under 1,000 hostile requests on
2 cores an unrelated stream went from 0.39x of its solo speed, when these threads were
instead left a core of their own, to 0.73-0.97x.

Their CPU time is the engine's own in the thread budget (``runner/threads.py``): the
forward keeps its cores rather than leave one to them. An API process compiles grammars
in such threads too, and never loads torch.
"""

from __future__ import annotations

import os
import sys
import threading

# How much lower than the steps' threads these run (a nice value: the OS gives a
# thread 10 lower about a tenth of a contended core)
LOWER_BY = 10


def lower_priority() -> None:
    """Called in a thread that works beside the steps (a thread pool's initializer):
    it runs at the lower priority from then on. Linux only, where a thread's nice value
    is its own; elsewhere the thread keeps the process's."""
    if not sys.platform.startswith("linux"):
        return
    try:
        priority = os.getpriority(os.PRIO_PROCESS, 0) + LOWER_BY
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), priority)
    except OSError:  # a sandbox that forbids it: the thread keeps the process's priority
        pass
