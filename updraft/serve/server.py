"""Running the app under uvicorn: ``updraft serve``."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvicorn

from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from updraft.engine.engine import Engine
from updraft.serve.app import build_app
from updraft.serve.connections import (
    ACCEPT_BURST,
    guarded_protocol,
    quiet_overload_logs,
    raise_descriptor_limit,
)
from updraft.serve.serving import ServeSettings

logger = logging.getLogger("updraft.serve")


def default_model_name(model: str | None) -> str:
    """The checkpoint directory's own name: clients need no more, and the server's
    metrics (open without a key) then reveal no path on the host."""
    return DEMO_MODEL_NAME if model is None else Path(model).expanduser().resolve().name


def make_server(
    engine: Engine,
    settings: ServeSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    **uvicorn_args: Any,
) -> uvicorn.Server:
    app = build_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        # uvicorn waits this long for open responses after SIGTERM before cancelling them.
        timeout_graceful_shutdown=settings.drain_timeout,
        http=guarded_protocol(settings.max_connections, settings.request_timeout),
        backlog=ACCEPT_BURST,
        **{"log_level": "info", **uvicorn_args},
    )
    return uvicorn.Server(config)


def serve(
    model: str | None,
    engine_args: dict[str, Any],
    settings: ServeSettings,
    host: str,
    port: int,
) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_overload_logs()
    model_dir = str(model or DEMO_MODEL_DIR)
    settings = replace(settings, max_connections=raise_descriptor_limit(settings.max_connections))
    # The address first: a port in use is found before a minute of loading, not after.
    listener = listening_socket(host, port)
    config = EngineConfig(model=model_dir, **engine_args)
    print(f"[updraft] {config.start_up_steps()} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    engine = Engine(config)
    print(f"[updraft] ready in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    port = listener.getsockname()[1]
    server = make_server(engine, settings, host, port)
    access = (
        "clients must send its API key"
        if settings.api_key
        else "it needs no API key: anyone who can reach this address can use it"
    )
    logger.info(
        "serving %r (from %s) on http://%s:%d; %s",
        settings.model_name,
        model_dir,
        host,
        port,
        access,
    )
    # uvicorn drains on SIGTERM and then raises the signal again; with this handler in
    # place that second delivery is a no-op, so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
    return 0 if server.started else 1


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
