"""Connections that cannot starve the server: a deadline for each request to arrive, and
a cap on open connections that evicts the laziest first.

A client that opens connections and sends requests a byte at a time (slowloris) holds a
file descriptor per connection. Without a bound, a few hundred exhaust the process's
descriptors and the server stops accepting anyone, health probes included. Here every
request must arrive whole within ``request_timeout`` seconds of the connection (or of
the previous response) being ready for it, and when more than ``max_connections`` are
open the one that has waited longest without a whole request is closed to make room.
A connection whose request is being answered is never evicted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("updraft.serve")
# Descriptors kept for everything but client connections: files, threads' pipes, ...
RESERVED_DESCRIPTORS = 64
# The event loop accepts up to this many connections in a burst before any of them is
# seen (and the idlest evicted): the cap leaves room for one burst.
ACCEPT_BURST = 64


class GuardedH11Protocol(H11Protocol):
    max_connections: int = 1024
    request_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            idle = next(iter(_waiting(self.server_state)), None)
            if getattr(self.server_state, "updraft_overload_logged", False) is False:
                self.server_state.updraft_overload_logged = True
                logger.warning(
                    "%d connections open, the limit: closing those that have waited longest "
                    "without sending a whole request (logged once)",
                    self.max_connections,
                )
            if idle is None:  # every connection is being answered: refuse this one
                transport.close()
                return
            idle.drop()
        self.await_request()

    def await_request(self) -> None:
        _waiting(self.server_state)[self] = None
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.loop.call_later(self.request_timeout, self.drop)

    def request_arrived(self) -> None:
        _waiting(self.server_state).pop(self, None)
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def drop(self) -> None:
        self.request_arrived()
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self.request_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.await_request()  # a kept-alive connection waits for its next request

    def connection_lost(self, exc: Exception | None) -> None:
        self.request_arrived()
        super().connection_lost(exc)


def _waiting(server_state: Any) -> OrderedDict[GuardedH11Protocol, None]:
    """The server's connections that await a whole request, oldest first."""
    waiting = getattr(server_state, "updraft_waiting", None)
    if waiting is None:
        waiting = server_state.updraft_waiting = OrderedDict()
    return waiting


class OnceFilter(logging.Filter):
    """Lets the first record of each listed message through, then counts the rest: an
    overloaded accept loop would otherwise log a traceback per attempt."""

    def __init__(self, *messages: str) -> None:
        super().__init__()
        self.messages = messages
        self.seen: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for known in self.messages:
            if message.startswith(known):
                self.seen[known] = self.seen.get(known, 0) + 1
                if self.seen[known] == 1:
                    record.msg = f"{message} (logged once; later ones are dropped)"
                    record.args = ()
                return self.seen[known] == 1
        return True


def quiet_overload_logs() -> None:
    """Log running out of file descriptors or connections once per process."""
    logging.getLogger("asyncio").addFilter(OnceFilter("socket.accept() out of system resource"))
    logging.getLogger("uvicorn.error").addFilter(OnceFilter("Exceeded concurrency limit"))


def guarded_protocol(max_connections: int, request_timeout: float) -> type[GuardedH11Protocol]:
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"max_connections": max_connections, "request_timeout": request_timeout},
    )


def raise_descriptor_limit(max_connections: int) -> int:
    """Lift the soft limit on open files to the hard one, and return how many client
    connections fit under it beside ``RESERVED_DESCRIPTORS``."""
    try:
        import resource
    except ImportError:  # not on this platform: trust the setting
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    fits = max(soft - RESERVED_DESCRIPTORS - ACCEPT_BURST, 16)
    if fits < max_connections:
        logger.warning(
            "only %d connections fit under the open-file limit of %d; capping at that", fits, soft
        )
    return min(max_connections, fits)
