"""Running the app under uvicorn: ``updraft serve``."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from updraft.engine.engine import Engine
from updraft.serve.api_processes import ApiProcesses
from updraft.serve.app import build_app
from updraft.serve.connections import (
    ACCEPT_BURST,
    guarded_protocol,
    quiet_overload_logs,
    raise_descriptor_limit,
)
from updraft.serve.engine_client import CoreLink, EngineClient, ShuttingDownError
from updraft.serve.engine_core import (
    CoreAddresses,
    CoreProcess,
    CoreThread,
    EngineInfo,
    engine_info,
)
from updraft.serve.metrics import MULTIPROCESS_ENV, shared_directory
from updraft.serve.serving import ServeSettings

logger = logging.getLogger("updraft.serve")


def default_model_name(model: str | None) -> str:
    """The checkpoint directory's own name: clients need no more, and the server's
    metrics (open without a key) then reveal no path on the host."""
    return DEMO_MODEL_NAME if model is None else Path(model).expanduser().resolve().name


# After the drain, what uvicorn waits for responses still being written.
CLOSE_TIMEOUT = 5.0
# How often an API process of several looks whether its supervising process is gone.
PARENT_POLL_SECONDS = 0.5


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
    **uvicorn_args: Any,
) -> DrainingServer:
    """A server in front of the engine core that ``link`` reaches."""
    app = build_app(link, info, settings)
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


def serve(
    model: str | None,
    engine_args: dict[str, Any],
    settings: ServeSettings,
    host: str,
    port: int,
    api_server_count: int = 1,
) -> int:
    """The engine in a process of its own, and ``api_server_count`` API processes in
    front of it on one port (the first is this process when there is one)."""
    if api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {api_server_count}")
    _configure_logging()
    model_dir = str(model or DEMO_MODEL_DIR)
    settings = replace(settings, max_connections=raise_descriptor_limit(settings.max_connections))
    # The address first: a port in use is found before a minute of loading, not after.
    listener = listening_socket(host, port)
    config = EngineConfig(model=model_dir, **engine_args)
    print(f"[updraft] {config.start_up_steps()} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    core = CoreProcess(config, api_server_count)
    try:
        info = core.start()
    except RuntimeError as error:
        listener.close()
        raise ValueError(str(error)) from None
    ready = f"[updraft] ready in {time.perf_counter() - start:.1f} s"
    if config.captures_in_background:
        ready += ", with eager steps until each graph is made (the engine's log says when)"
    print(ready, file=sys.stderr, flush=True)
    port = listener.getsockname()[1]
    access = (
        "clients must send its API key"
        if settings.api_key
        else "it needs no API key: anyone who can reach this address can use it"
    )
    logger.info(
        "serving %r (from %s) on http://%s:%d with %d API process%s; %s",
        settings.model_name,
        model_dir,
        host,
        port,
        api_server_count,
        "" if api_server_count == 1 else "es",
        access,
    )
    try:
        if api_server_count == 1:
            link = CoreLink(core.addresses, 0, None, core.is_alive, core.join)
            return 0 if _run_server(link, info, settings, host, listener) else 1
        return supervise_api_processes(core, info, settings, listener, host, api_server_count)
    finally:
        listener.close()
        if core.is_alive():  # the API process stopped without stopping it
            core.shutdown()


def supervise_api_processes(
    core: CoreProcess,
    info: EngineInfo,
    settings: ServeSettings,
    listener: socket.socket,
    host: str,
    count: int,
) -> int:
    """Run ``count`` API processes on ``listener`` and wait for them. Signals are passed
    on (each process drains on the first, quits on the second; they sit in their own
    process group, so a terminal's Ctrl-C reaches them once, through here); once all
    have exited, the engine is stopped. If the engine dies, they are told: /health
    then answers 503 and requests fail at once. One that dies is put back
    (serve/api_processes.py). Their /metrics show all of their counts (files in the
    engine's socket directory, which goes with it)."""
    context = multiprocessing.get_context("spawn")
    engine_dead = context.Event()
    shared_directory(os.path.join(core.addresses.directory, "metrics"))

    def spawn(index: int) -> BaseProcess:
        process = context.Process(
            target=run_api_process,
            args=(index, core.addresses, info, settings, listener, host, engine_dead, os.getpid()),
            name=f"updraft-api-{index}",
        )
        process.start()
        return process

    try:
        processes = ApiProcesses(count, spawn, core)
        signal.signal(signal.SIGTERM, processes.forward)
        signal.signal(signal.SIGINT, processes.forward)
        return processes.watch(engine_dead)
    finally:
        os.environ.pop(MULTIPROCESS_ENV, None)


def run_api_process(
    index: int,
    addresses: CoreAddresses,
    info: EngineInfo,
    settings: ServeSettings,
    listener: socket.socket,
    host: str,
    engine_dead: multiprocessing.synchronize.Event,
    supervisor: int,
) -> None:
    """One of several API processes: a server on the shared listening socket, client
    ``index`` of the engine core."""
    os.setpgrp()  # signals come from the supervising process, not the terminal
    _exit_with_parent(supervisor)
    _configure_logging()
    link = CoreLink(addresses, index, None, lambda: not engine_dead.is_set(), None)
    sys.exit(0 if _run_server(link, info, settings, host, listener) else 1)


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_overload_logs()


def _run_server(
    link: CoreLink,
    info: EngineInfo,
    settings: ServeSettings,
    host: str,
    listener: socket.socket,
) -> bool:
    """Serve on ``listener`` until a drain ends; whether the server had started."""
    server = server_over(link, info, settings, host, listener.getsockname()[1])
    # uvicorn drains on SIGTERM and then raises the signal again; with this handler in
    # place that second delivery is a no-op, so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[listener])
    return server.started


def _exit_with_parent(parent: int) -> None:
    """End this process at once if ``parent``, the process that started it, is gone
    (killed outright: it had no chance to stop this one, and the engine process has gone
    with it). The pid is passed in: read here, it could already be init's."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="updraft-parent-watch", daemon=True).start()


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it), or an OSError that names
    the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError as error:
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return listener
