"""One background thread that owns the engine and serves every connection.

The engine is synchronous and not thread-safe, so only the loop thread ever touches it.
Handlers on the asyncio side send commands (add, abort) through a queue that the loop
thread applies between steps, and get their outputs back through a per-request
``asyncio.Queue`` filled with ``call_soon_threadsafe``. Requests from all connections
share each step: that is the continuous batching.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from updraft.engine.engine import Engine
from updraft.engine.stats import EngineStats
from updraft.outputs import RequestOutput
from updraft.sampling_params import SamplingParams
from updraft.serve.metrics import ServerMetrics

logger = logging.getLogger("updraft.serve")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an unexpected error; no request can be served."""


class ShuttingDownError(RuntimeError):
    """The server is draining before it exits and takes no new requests."""


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException]
    arrival_time: float
    last_token_time: float | None = None


@dataclass
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    stream: _Stream


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Cut:
    """End every running request with ``error`` (the drain's timeout has passed)."""

    error: BaseException


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stats: EngineStats = engine.stats()
        self._commands: collections.deque[_Add | _Abort | _Cut] = collections.deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._num_in_flight = 0  # asyncio side only: handlers between add and finish
        # Asyncio side only (the loop thread reports through call_soon_threadsafe): adds
        # the loop has not applied, and aborts of applied adds it has not applied. A
        # request whose client has gone counts in neither, so it holds no waiting place.
        self._unapplied: set[str] = set()
        self._aborting: set[str] = set()
        self._stop = False
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- lifecycle (asyncio side) ----------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="updraft-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_accepting(self) -> None:
        """New requests get ShuttingDownError from now on (a drain has begun)."""
        self._accepting = False

    def cut(self, error: BaseException) -> None:
        """End every request the loop serves with ``error``, aborting it in the engine."""
        self._send(_Cut(error))

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running, including adds the loop has not seen,
        and not those whose client has gone."""
        held = max(0, self.stats.num_waiting - len(self._aborting))
        return held + len(self._unapplied)

    async def shutdown(self, timeout: float) -> None:
        """Stop taking requests, let the running ones finish (up to ``timeout`` seconds),
        abort what is left, and stop the loop thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._num_in_flight and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    # -- requests (asyncio side) -----------------------------------------------------------

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Closing or cancelling the
        iterator early aborts the request, which frees its KV blocks."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down")
        stream = _Stream(asyncio.Queue(), time.perf_counter())
        self._num_in_flight += 1
        self._unapplied.add(request_id)
        self._send(_Add(request_id, prompt, params, stream))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._num_in_flight -= 1
            if not finished:
                if request_id in self._unapplied:
                    self._unapplied.discard(request_id)
                else:
                    self._aborting.add(request_id)
                self._send(_Abort(request_id))

    def _send(self, command: _Add | _Abort | _Cut) -> None:
        self._commands.append(command)
        self._wakeup.set()

    # -- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._commands:
                    self._apply_commands()
                    self._publish_stats()  # admission control sees new adds at once
                if self.engine.has_unfinished:
                    outputs = self.engine.step()
                    self._deliver(outputs)
                    self._publish_stats()
                    continue
                self._publish_stats()
                if self._stop:
                    return
                # Wait, clear, then drain: a command sent after the drain sets the event
                # again, so no wakeup is lost.
                self._wakeup.wait()
                self._wakeup.clear()
        except BaseException as error:
            logger.exception("engine loop failed; failing every request")
            self.error = error
            self._fail_all(EngineDeadError(f"the engine loop failed: {error!r}"))

    def _apply_commands(self) -> None:
        # An add whose abort is queued behind it never reaches the engine: in an abort
        # storm the engine spends nothing on requests nobody waits for.
        aborted = {c.request_id for c in self._commands if isinstance(c, _Abort)}
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                self._call_soon(self._unapplied.discard, command.request_id)
                if command.request_id in aborted:
                    continue
                try:
                    self.engine.add_request(command.prompt, command.params, command.request_id)
                except Exception as error:  # a bug in one request must not stop the loop
                    logger.exception("cannot add request %s", command.request_id)
                    self._call_soon(command.stream.queue.put_nowait, error)
                    continue
                self._streams[command.request_id] = command.stream
            elif isinstance(command, _Cut):
                for request_id, stream in self._streams.items():
                    self.engine.abort(request_id)
                    self._call_soon(stream.queue.put_nowait, command.error)
                self._streams.clear()
            else:
                self._call_soon(self._aborting.discard, command.request_id)
                if command.request_id in self._streams:
                    del self._streams[command.request_id]
                    if self.engine.abort(command.request_id) and self.metrics is not None:
                        self.metrics.finished("abort")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        batch: list[tuple[asyncio.Queue, RequestOutput]] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted by its client; nobody is listening
                continue
            if self.metrics is not None:
                self._observe(stream, output, now)
            if output.finished:
                del self._streams[output.request_id]
            batch.append((stream.queue, output))
        if batch:
            self._call_soon(_put_all, batch)

    def _observe(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        metrics = self.metrics
        new_tokens = len(output.outputs[0].delta_token_ids)
        if new_tokens:
            if stream.last_token_time is None:
                metrics.prompt_tokens.inc(output.metrics.num_prompt_tokens)
                metrics.time_to_first_token.observe(now - stream.arrival_time)
            else:
                metrics.inter_token_latency.observe(now - stream.last_token_time)
            stream.last_token_time = now
            metrics.generation_tokens.inc(new_tokens)
        if output.finished:
            reason = output.outputs[0].finish_reason or "unknown"
            metrics.finished(reason)
            metrics.request_latency.observe(now - stream.arrival_time)

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()
        if self.metrics is not None:
            self.metrics.publish(self.stats)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            self._call_soon(stream.queue.put_nowait, error)
        self._streams.clear()
        # Adds that never reached the engine must not wait forever either.
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                self._call_soon(command.stream.queue.put_nowait, error)

    def _call_soon(self, callback: Callable, *args: object) -> None:
        # A closed event loop raises RuntimeError: nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, *args)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, output in batch:
        queue.put_nowait(output)
