"""Running the app under uvicorn: ``updraft serve``."""

from __future__ import annotations

import logging
import signal
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
    engine = Engine(EngineConfig(model=model_dir, **engine_args))
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
    server.run()
    return 0 if server.started else 1
