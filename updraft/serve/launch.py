"""How ``updraft serve`` starts: the engine process first, the API side beside it.

The engine process (``serve/engine_core.py``) loads torch and the model, which is most
of a start. An API process needs none of that: the tokenizer, the chat template, the
request checks and the wire format, not tensors. So this process binds the port, spawns
the engine process before it loads anything heavy, and only then loads the API's own
stack (uvicorn, FastAPI, the model's tokenizer): the two load side by side. Each API
process listens once the engine is ready, so /health answers only when a request can be
served, as before.

With one API process, this process is it; with several, this process supervises them
(``serve/api_processes.py``), and they load beside the engine too.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from updraft.c_builds import built, kernels_for, prebuild
from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from updraft.serve.engine_process import CoreProcess

if TYPE_CHECKING:
    from updraft.serve.engine_core import EngineInfo
    from updraft.serve.settings import ServeSettings

logger = logging.getLogger("updraft.serve")


def default_model_name(model: str | None) -> str:
    """The checkpoint directory's own name: clients need no more, and the server's
    metrics (open without a key) then reveal no path on the host."""
    return DEMO_MODEL_NAME if model is None else Path(model).expanduser().resolve().name


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
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The address first: a port in use is found before a minute of loading, not after.
    listener = listening_socket(host, port)
    model_dir = str(model or DEMO_MODEL_DIR)
    config = EngineConfig(model=model_dir, **engine_args)
    print(f"[updraft] {config.start_up_steps()} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    # The compiler runs beside the engine process's import of torch; that process waits
    # for these builds, not compiling the kernels again.
    building = prebuild(kernels_for(model_dir))
    core = CoreProcess(config, api_server_count)
    core.spawn()
    if building:  # a first start: the API loads once the compiler and torch's import are done
        print(f"[updraft] building the kernels {', '.join(building)} ...", file=sys.stderr)
        for kernel in building:  # on two cores that way the engine was ready 0.6 s sooner
            with contextlib.suppress(RuntimeError):  # the engine process says why it failed
                built(kernel)

    def engine_ready() -> EngineInfo:
        """Wait for the engine; say so once it is ready."""
        try:
            info = core.wait_ready()
        except RuntimeError as error:
            raise ValueError(str(error)) from None
        _say_ready(config, model_dir, settings, host, listener, api_server_count, start)
        return info

    # The rest is loaded once the engine process is on its way: the two load side by side.
    try:
        if api_server_count > 1:
            from updraft.serve.api_processes import supervise_api_processes

            return supervise_api_processes(
                core, engine_ready, settings, config.model, listener, host, api_server_count
            )
        from updraft.serve.engine_client import CoreLink
        from updraft.serve.server import run_api

        link = CoreLink(core.addresses, 0, None, core.is_alive, core.join)
        return 0 if run_api(link, engine_ready, settings, config.model, host, listener) else 1
    finally:
        listener.close()
        if core.is_alive():  # the API process stopped without stopping it
            core.shutdown()


def _say_ready(
    config: EngineConfig,
    model_dir: str,
    settings: ServeSettings,
    host: str,
    listener: socket.socket,
    api_server_count: int,
    start: float,
) -> None:
    ready = f"[updraft] ready in {time.perf_counter() - start:.1f} s"
    if config.captures_in_background:
        ready += ", with eager steps until each graph is made (the engine's log says when)"
    print(ready, file=sys.stderr, flush=True)
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
        listener.getsockname()[1],
        api_server_count,
        "" if api_server_count == 1 else "es",
        access,
    )


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
