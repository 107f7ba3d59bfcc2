"""The engine process as the server's own process sees it: spawned, its readiness
awaited, told when an API process died, stopped.

Light to import: ``updraft serve`` spawns the engine process before it loads anything
heavy (serve/launch.py). The engine side (serve/engine_core.py, and torch under it)
loads only in the spawned process.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from updraft.config import EngineConfig
from updraft.serve.core_addresses import CoreAddresses

if TYPE_CHECKING:
    from updraft.serve.engine_core import EngineInfo

logger = logging.getLogger("updraft.serve")

# How long an engine process told to stop may take (it finishes its step and closes its
# ranks).
JOIN_SECONDS = 30


class CoreProcess:
    """The core in a process of its own that builds the engine from ``config``; its
    sockets live in a directory only this user can open, removed when it ends."""

    def __init__(self, config: EngineConfig, num_clients: int = 1) -> None:
        self.addresses = CoreAddresses.in_directory(
            tempfile.mkdtemp(prefix="updraft-core-"), num_clients
        )
        context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads
        self._ready, ready = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_engine_process,
            args=(config, self.addresses, ready, os.getpid()),
            name="updraft-engine",
        )
        self._ready_end = ready
        self.ready = False  # whether its engine was built (its sockets are bound)

    def start(self) -> EngineInfo:
        """Start the process and wait until its engine is built; raises RuntimeError with
        the engine's own message if it could not be."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the process; it builds its engine while this one goes on."""
        self.process.start()
        self._ready_end.close()

    def wait_ready(self) -> EngineInfo:
        """Wait until the engine is built; raises RuntimeError with the engine's own
        message if it could not be."""
        try:
            kind, value = self._ready.recv()
        except EOFError:
            self.join()
            raise RuntimeError(
                f"the engine process exited with code {self.process.exitcode} before it was ready"
            ) from None
        if kind == "error":
            self.join()
            raise RuntimeError(value)
        self.ready = True
        return value

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self) -> None:
        """Tell the core to stop (from a process that is not one of its clients), then
        wait for it. One that is still building its engine (the server failed to start,
        or was interrupted) listens to nothing yet: it is terminated."""
        if self.ready:
            self._tell(["shutdown"])
        else:
            self.process.terminate()
        self.join()

    def client_gone(self, client: int) -> None:
        """Tell the core that API process ``client`` died: its requests are aborted."""
        self._tell(["client_gone", client])

    def _tell(self, message: list) -> None:
        # Loaded at the first message, never before the engine process is spawned.
        import zmq

        from updraft.serve import wire

        context = zmq.Context()
        socket = wire.push_socket(context, self.addresses.input)
        socket.send(wire.pack(message))
        socket.close(linger=1000)  # until the core has it
        context.term()

    def join(self) -> None:
        """Wait for the process to end (it was told to), then make sure it has."""
        self.process.join(JOIN_SECONDS)
        if self.process.is_alive():
            logger.warning("the engine process did not stop; killing it")
            self.process.kill()
            self.process.join()
        shutil.rmtree(self.addresses.directory, ignore_errors=True)


def _engine_process(
    config: EngineConfig,
    addresses: CoreAddresses,
    ready: multiprocessing.connection.Connection,
    parent: int,
) -> None:
    """The spawned process: the engine side loads here, not in the process that spawns
    it (``run_core_process`` says what it does)."""
    from updraft.serve.engine_core import run_core_process

    run_core_process(config, addresses, ready, parent)
