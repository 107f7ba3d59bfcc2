"""Several API processes in front of one engine core (``--api-server-count``): started,
watched, and one that dies put back.

An API process killed or crashed leaves requests in the engine that nobody will read.
The supervising process sees it exit, tells the core (which aborts them, freeing their
KV blocks) and starts another in its place on the same listening socket and client
index, while the others go on serving. One that keeps dying is left dead after a few
tries; the others serve on.
"""

from __future__ import annotations

import logging
import multiprocessing.synchronize
import os
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

from updraft.serve.engine_core import CoreProcess
from updraft.serve.metrics import process_gone

logger = logging.getLogger("updraft.serve")

# How often the supervisor looks at its processes and the engine's.
POLL_SECONDS = 0.2
# An API process is started again at most this many times within the window.
RESTARTS_PER_WINDOW = 3
RESTART_WINDOW_SECONDS = 60.0


class ApiProcesses:
    """``count`` API processes, each made and started by ``spawn(index)``."""

    def __init__(self, count: int, spawn: Callable[[int], BaseProcess], core: CoreProcess) -> None:
        self.spawn = spawn
        self.core = core
        self.processes = [spawn(index) for index in range(count)]
        self._restarts: list[list[float]] = [[] for _ in range(count)]
        self._handled: set[int] = set()  # pids whose exit has been dealt with
        self._stopping = False

    def forward(self, signum: int, frame: FrameType | None) -> None:
        """A signal handler: pass the signal on; exits from now on are the server's."""
        self._stopping = True
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    def watch(self, engine_dead: multiprocessing.synchronize.Event) -> int:
        """Until every API process has exited: put back those that die, and set
        ``engine_dead`` if the engine process exits. The exit status: 0 if the last of
        each index exited cleanly."""
        while True:
            if not engine_dead.is_set() and not self.core.is_alive():
                logger.error("the engine process exited; the API processes now answer 503")
                engine_dead.set()
            for index, process in enumerate(self.processes):
                if process.exitcode is not None and process.pid not in self._handled:
                    self._exited(index, process, engine_alive=not engine_dead.is_set())
            if not any(process.is_alive() for process in self.processes):
                break
            time.sleep(POLL_SECONDS)
        return 0 if all(process.exitcode == 0 for process in self.processes) else 1

    def _exited(self, index: int, process: BaseProcess, engine_alive: bool) -> None:
        self._handled.add(process.pid)
        process_gone(process.pid)
        unexpected = not self._stopping
        if engine_alive and (unexpected or process.exitcode != 0):
            self.core.client_gone(index)  # its requests are aborted in the engine
        if not unexpected or not engine_alive:
            return
        now = time.monotonic()
        recent = [t for t in self._restarts[index] if now - t < RESTART_WINDOW_SECONDS]
        if len(recent) >= RESTARTS_PER_WINDOW:
            logger.error(
                "API process %d exited with code %s, its requests aborted; it died %d times "
                "in %g s, so it is not started again: the others serve on",
                index,
                process.exitcode,
                len(recent) + 1,
                RESTART_WINDOW_SECONDS,
            )
            return
        logger.error(
            "API process %d exited with code %s; its requests were aborted in the engine; "
            "starting another in its place",
            index,
            process.exitcode,
        )
        self._restarts[index] = [*recent, now]
        self.processes[index] = self.spawn(index)
