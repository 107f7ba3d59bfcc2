"""Threads that work beside the steps (grammar compiles and masks): their CPU time
counts as another process's in the thread budget (``runner/threads.py``), so the
forward leaves them their core.

Apart from the budget, which sets torch's thread count: an API process compiles
grammars in such threads too, and never loads torch.
"""

from __future__ import annotations

import threading

# Native ids of this process's threads whose CPU time counts as another process's.
SIDE_THREADS: set[int] = set()


def count_as_other() -> None:
    """Called in a thread that works beside the steps (a thread pool's initializer):
    the cores it keeps busy are left to it, as to another process."""
    SIDE_THREADS.add(threading.get_native_id())
