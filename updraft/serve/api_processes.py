"""Several API processes in front of one engine core (``--api-server-count``): started,
watched, and one that dies put back.

They are started while the engine process is still loading the model, and load their
own stack meanwhile (each is a spawned interpreter, and none loads torch); each waits
for the engine's limits, which the supervising process passes on once the engine is
ready, before it listens.

An API process killed or crashed leaves requests in the engine that nobody will read.
The supervising process sees it exit, tells the core (which aborts them, freeing their
KV blocks) and starts another in its place on the same listening socket and client
index, while the others go on serving. One that keeps dying is left dead after a few
tries; the others serve on.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.synchronize
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

from updraft.serve.core_addresses import CoreAddresses
from updraft.serve.engine_core import EngineInfo
from updraft.serve.engine_process import CoreProcess
from updraft.serve.metrics import MULTIPROCESS_ENV, process_gone, shared_directory
from updraft.serve.settings import ServeSettings

logger = logging.getLogger("updraft.serve")

# How often the supervisor looks at its processes and the engine's.
POLL_SECONDS = 0.2
# How often an API process looks whether its supervising process is gone.
PARENT_POLL_SECONDS = 0.5
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

    def join(self) -> None:
        """Wait for every API process to exit (each was told to)."""
        for process in self.processes:
            process.join()

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


def supervise_api_processes(
    core: CoreProcess,
    engine_ready: Callable[[], EngineInfo],
    settings: ServeSettings,
    model: str,
    listener: socket.socket,
    host: str,
    count: int,
) -> int:
    """Run ``count`` API processes on ``listener`` and wait for them. They start at
    once, while ``engine_ready`` waits for the engine, and each gets the engine's limits
    once it is ready. Signals are passed on (each process drains on the first, quits on
    the second; they sit in their own process group, so a terminal's Ctrl-C reaches them
    once, through here); once all have exited, the engine is stopped. If the engine
    dies, they are told: /health then answers 503 and requests fail at once. One that
    dies is put back. Their /metrics show all of their counts (files in the engine's
    socket directory, which goes with it)."""
    context = multiprocessing.get_context("spawn")
    engine_dead = context.Event()
    shared_directory(os.path.join(core.addresses.directory, "metrics"))
    limits = EngineLimitsPost()

    def spawn(index: int) -> BaseProcess:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=run_api_process,
            args=(
                index,
                core.addresses,
                receive,
                settings,
                model,
                listener,
                host,
                engine_dead,
                os.getpid(),
            ),
            name=f"updraft-api-{index}",
        )
        process.start()
        receive.close()
        limits.post_to(send)
        return process

    try:
        processes = ApiProcesses(count, spawn, core)
        try:
            limits.ready(engine_ready())
        except BaseException:
            limits.close()  # each API process, waiting for them, exits
            processes.join()
            raise
        signal.signal(signal.SIGTERM, processes.forward)
        signal.signal(signal.SIGINT, processes.forward)
        return processes.watch(engine_dead)
    finally:
        os.environ.pop(MULTIPROCESS_ENV, None)


class EngineLimitsPost:
    """The engine's limits to every API process, each through a pipe of its own: sent
    once the engine is ready, at once to one started after that (put back)."""

    def __init__(self) -> None:
        self.info: EngineInfo | None = None
        self._waiting: list[multiprocessing.connection.Connection] = []

    def post_to(self, pipe: multiprocessing.connection.Connection) -> None:
        self._waiting.append(pipe)
        if self.info is not None:
            self.ready(self.info)

    def ready(self, info: EngineInfo) -> None:
        self.info = info
        for pipe in self._waiting:
            # One that died while it loaded has closed its end: it is put back.
            with contextlib.suppress(BrokenPipeError):
                pipe.send(info)
        self.close()

    def close(self) -> None:
        for pipe in self._waiting:
            pipe.close()
        self._waiting = []


def run_api_process(
    index: int,
    addresses: CoreAddresses,
    limits: multiprocessing.connection.Connection,
    settings: ServeSettings,
    model: str,
    listener: socket.socket,
    host: str,
    engine_dead: multiprocessing.synchronize.Event,
    supervisor: int,
) -> None:
    """One of several API processes: a server on the shared listening socket, client
    ``index`` of the engine core, once ``limits`` brings the engine's."""
    os.setpgrp()  # signals come from the supervising process, not the terminal
    _exit_with_parent(supervisor)
    # Loaded here: the supervising process never needs the API's stack.
    from updraft.serve.engine_client import CoreLink
    from updraft.serve.server import run_api

    def engine_ready() -> EngineInfo:
        try:
            return limits.recv()
        except EOFError:  # the engine did not start: the supervising process says why
            raise SystemExit(1) from None

    link = CoreLink(addresses, index, None, lambda: not engine_dead.is_set(), None)
    sys.exit(0 if run_api(link, engine_ready, settings, model, host, listener) else 1)


def _exit_with_parent(parent: int) -> None:
    """End this process at once if ``parent``, the process that started it, is gone
    (killed outright: it had no chance to stop this one, and the engine process has gone
    with it). The pid is passed in: read here, it could already be init's."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="updraft-parent-watch", daemon=True).start()
