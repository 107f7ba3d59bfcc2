"""The API server: the app under uvicorn, draining on a signal, and the life of one
API process (``run_api``): the model's files read while the engine process loads the
model, then a server on the shared listening socket once the engine is ready. How
``updraft serve`` starts its processes is ``serve/launch.py``'s.

No module here loads torch: an API process needs the tokenizer, not tensors.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from updraft.serve.app import ServedFiles, build_app
from updraft.serve.connections import (
    ACCEPT_BURST,
    guarded_protocol,
    quiet_overload_logs,
    raise_descriptor_limit,
)
from updraft.serve.engine_client import CoreLink, EngineClient, ShuttingDownError
from updraft.serve.engine_core import CoreThread, EngineInfo, engine_info
from updraft.serve.settings import ServeSettings

if TYPE_CHECKING:
    from updraft.engine.engine import Engine

logger = logging.getLogger("updraft.serve")


# After the drain, what uvicorn waits for responses still being written.
CLOSE_TIMEOUT = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn, draining first. At the first SIGTERM or SIGINT the server keeps its port
    open while new requests and /health get 503 and running requests finish; at the
    drain timeout, streams still running end with an error event and ``data: [DONE]``
    (a request that does not stream gets a 503). Only then does uvicorn shut down, with
    nothing left to cancel. A second SIGINT exits at once, as uvicorn does."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, drain_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if sockets and not self.should_exit:  # uvicorn says where only for its own sockets
            host, port = sockets[0].getsockname()[:2]
            logger.info("Uvicorn running on http://%s:%d (Ctrl-C drains, then quits)", host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        # A signal handler may run in the middle of the loop's own code: hand over.
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain(sig)))

    async def _drain(self, sig: int) -> None:
        engine = self.engine
        engine.stop_accepting()
        logger.info(
            "draining: %d requests running, up to %g s; new requests get 503",
            engine.num_in_flight,
            self.drain_timeout,
        )
        deadline = time.monotonic() + self.drain_timeout
        while engine.num_in_flight and engine.is_alive and time.monotonic() < deadline:
            if self.should_exit:  # a second signal: uvicorn is shutting down anyway
                return
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            logger.info("drain timeout: cutting %d requests", engine.num_in_flight)
            engine.cut(
                ShuttingDownError(
                    f"the server shut down: the request was cut after the {self.drain_timeout:g} s "
                    "drain; retry elsewhere or later"
                )
            )
            end = time.monotonic() + CLOSE_TIMEOUT
            while engine.num_in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        super().handle_exit(sig, None)


def make_server(
    engine: Engine,
    settings: ServeSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    **uvicorn_args: Any,
) -> DrainingServer:
    """A server over an engine already built, its core in a thread of this process."""
    core = CoreThread(engine)
    link = CoreLink(core.addresses, 0, core.start, core.is_alive, core.join)
    return server_over(link, engine_info(engine), settings, host, port, **uvicorn_args)


def server_over(
    link: CoreLink,
    info: EngineInfo,
    settings: ServeSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    files: ServedFiles | None = None,
    **uvicorn_args: Any,
) -> DrainingServer:
    """A server in front of the engine core that ``link`` reaches."""
    app = build_app(link, info, settings, files)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        # The drain has ended every response by then; this bounds a slow client's last read.
        timeout_graceful_shutdown=CLOSE_TIMEOUT,
        http=guarded_protocol(settings.max_connections, settings.request_timeout),
        backlog=ACCEPT_BURST,
        **{"log_level": "info", **uvicorn_args},
    )
    return DrainingServer(config, app.state.engine, settings.drain_timeout)


def run_api(
    link: CoreLink,
    engine_ready: Callable[[], EngineInfo],
    settings: ServeSettings,
    model: str,
    host: str,
    listener: socket.socket,
) -> bool:
    """One API process: read ``model``'s files while the engine builds, wait for
    ``engine_ready`` (the engine's limits; it raises if the engine could not start),
    then serve on ``listener`` until a drain ends; whether the server had started.
    Nothing listens until the engine is ready: a client is refused until then, so
    /health answers only when a request can be served."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_overload_logs()
    settings = replace(settings, max_connections=raise_descriptor_limit(settings.max_connections))
    try:
        files = ServedFiles.read(model)
    except Exception:
        engine_ready()  # the engine reads the same files: its message comes first
        raise
    print(
        f"[updraft] API process {link.client} loaded; it listens once the engine is ready",
        file=sys.stderr,
        flush=True,
    )
    info = engine_ready()
    server = server_over(link, info, settings, host, listener.getsockname()[1], files)
    # uvicorn drains on SIGTERM and then raises the signal again; with this handler in
    # place that second delivery is a no-op, so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[listener])
    return server.started
