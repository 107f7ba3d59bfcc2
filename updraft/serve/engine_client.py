"""The API process's side of the engine core: requests out, outputs back, on asyncio.

Handlers call ``generate``, which sends the add to the engine core (serve/engine_core.py)
and yields the request's outputs as they come back; closing it early sends the abort.
One task receives everything the core sends this process, turns each sequence's tokens
into outputs (serve/served_request.py: text and stop strings are decoded here), and
hands them to their handlers' queues. Requests of every connection, and of every API
process, share each engine step: that is the continuous batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from updraft.engine.input_processor import EngineRequest
from updraft.outputs import RequestOutput
from updraft.sampling_params import SamplingParams
from updraft.serve import wire
from updraft.serve.core_addresses import CoreAddresses
from updraft.serve.metrics import ServerMetrics
from updraft.serve.served_request import ServedRequest
from updraft.tokenizer import Tokenizer

logger = logging.getLogger("updraft.serve")

# How often the receiving task, with nothing to read, checks that the core still runs.
LIVENESS_POLL_MS = 500


class EngineDeadError(RuntimeError):
    """The engine core stopped on an unexpected error; no request can be served."""


class ShuttingDownError(RuntimeError):
    """The server is draining before it exits and takes no new requests."""


@dataclass(frozen=True)
class CoreLink:
    """How an API process reaches its engine core. ``start_core``: starts a core that
    runs in this process (once this side's socket is bound). ``core_alive``: whether
    the core's thread or process still runs, where this process can tell. ``stop_core``:
    waits for the core to end after it was sent the shutdown, where this process owns
    it (None: another process does)."""

    addresses: CoreAddresses
    client: int = 0  # this API process's index among those the core serves
    start_core: Callable[[], None] | None = None
    core_alive: Callable[[], bool] = lambda: True
    stop_core: Callable[[], None] | None = None


class EngineClient:
    def __init__(
        self,
        link: CoreLink,
        tokenizer: Tokenizer | None,
        metrics: ServerMetrics | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """``eos_token_ids``: the model's, whose text a reply they end leaves out."""
        self.link = link
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.metrics = metrics
        self.stats = wire.CoreStats()
        self._requests: dict[str, ServedRequest] = {}
        self._num_in_flight = 0  # handlers between add and finish
        # Adds the core has not applied, and aborts of applied adds it has not applied:
        # a request whose client has gone counts in neither, so it holds no waiting place.
        self._unapplied: set[str] = set()
        self._aborting: set[str] = set()
        self._accepting = True
        self._context: zmq.asyncio.Context | None = None
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Connect to the core and start receiving (on the running event loop)."""
        addresses = self.link.addresses
        self._context = zmq.asyncio.Context()
        self._output = wire.pull_socket(self._context, addresses.outputs[self.link.client])
        if self.link.start_core is not None:
            self.link.start_core()
        self._input = wire.push_socket(self._context, addresses.input)
        self._send(["hello", self.link.client])  # in the place of one that died, if any
        self._receiver = asyncio.get_running_loop().create_task(self._receive())

    @property
    def is_alive(self) -> bool:
        return (
            self._receiver is not None
            and not self._receiver.done()
            and self.error is None
            and self.link.core_alive()
        )

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
        """End every running request with ``error`` (each handler then aborts its own)."""
        for served in self._requests.values():
            served.queue.put_nowait(error)
        self._requests.clear()

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running, including adds the core has not seen,
        and not those whose client has gone."""
        held = max(0, self.stats.num_waiting - len(self._aborting))
        return held + len(self._unapplied)

    async def shutdown(self, timeout: float) -> None:
        """Stop taking requests, let the running ones finish (up to ``timeout`` seconds),
        cut what is left, and stop the core if this process owns it."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._num_in_flight and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.cut(ShuttingDownError("the server shut down"))
        if self.link.stop_core is not None and self._input is not None:
            self._send(["shutdown"])
            await asyncio.to_thread(self.link.stop_core)
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        if self._context is not None:
            for socket in (self._input, self._output):
                if socket is not None:
                    socket.close(linger=0)
            self._context.term()
            self._context = None

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: EngineRequest | Sequence[int],
        params: SamplingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Closing or cancelling the
        iterator early aborts the request, which frees its KV blocks. ``prompt``: a
        request through intake (engine/input_processor.py), or token ids the caller has
        checked, with their ``params``: the engine core queues what it is sent as it is."""
        if not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down")
        intake = prompt
        if not isinstance(intake, EngineRequest):
            intake = EngineRequest(None, list(prompt), params)
        # Packed before anything is registered: a request the wire cannot carry raises
        # here and leaves nothing in flight (a shutdown would wait on it forever).
        add = wire.pack(["add", self.link.client, request_id, *wire.request_to_wire(intake)])
        served = ServedRequest(request_id, intake, self.tokenizer, self.eos_token_ids)
        self._requests[request_id] = served
        self._num_in_flight += 1
        self._unapplied.add(request_id)
        self._send_packed(add)
        finished = failed = False
        try:
            while not finished:
                item = await served.queue.get()
                if isinstance(item, BaseException):
                    failed = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._num_in_flight -= 1
            self._requests.pop(request_id, None)
            if not finished:
                if request_id in self._unapplied:
                    self._unapplied.discard(request_id)
                else:
                    self._aborting.add(request_id)
                self._send(["abort", self.link.client, [request_id]])
                if self.metrics is not None and not failed:
                    self.metrics.finished("abort")

    def _send(self, message: list[Any]) -> None:
        self._send_packed(wire.pack(message))

    def _send_packed(self, packed: bytes) -> None:
        if self._input is not None:
            self._input.send(packed, zmq.NOBLOCK)

    # -- what the core sends ---------------------------------------------------------------

    async def _receive(self) -> None:
        try:
            while True:
                if not await self._output.poll(LIVENESS_POLL_MS):
                    if not self.link.core_alive():
                        raise EngineDeadError("the engine core exited")
                    continue
                message = wire.unpack(await self._output.recv())
                if message[0] == "failed":
                    raise EngineDeadError(message[1])
                self._apply_step(*message[1:])
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            logger.error("%s; failing every request", error)
            self.error = error
            self.cut(error if isinstance(error, EngineDeadError) else EngineDeadError(repr(error)))

    def _apply_step(
        self, deltas: list[list], stats: list, applied: list[str], aborted: list[str]
    ) -> None:
        self._unapplied.difference_update(applied)
        self._aborting.difference_update(aborted)
        self.stats = wire.CoreStats(*stats)
        if self.metrics is not None:
            self.metrics.publish(self.stats)
        now = time.perf_counter()
        stops = []
        for fields in deltas:
            delta = wire.SequenceDelta(*fields)
            served = self._requests.get(delta.request_id)
            if served is None:  # aborted by its client; nobody is listening
                continue
            output, stopped = served.apply(delta)
            if stopped:
                stops.append([delta.request_id, delta.index])
            if output is None:
                continue
            if self.metrics is not None:
                self._observe(served, output, now)
            if output.finished:
                del self._requests[delta.request_id]
            served.queue.put_nowait(output)
        if stops:
            self._send(["stop", stops])

    def _observe(self, served: ServedRequest, output: RequestOutput, now: float) -> None:
        metrics = self.metrics
        completion = output.outputs[0]
        new_tokens = len(completion.delta_token_ids)
        if new_tokens:
            if served.last_token_time is None:
                metrics.prompt_tokens.inc(output.metrics.num_prompt_tokens)
                metrics.time_to_first_token.observe(now - served.arrival_time)
            else:
                metrics.inter_token_latency.observe(now - served.last_token_time)
            served.last_token_time = now
            metrics.generation_tokens.inc(new_tokens)
        if output.finished:
            metrics.finished(completion.finish_reason or "unknown")
            metrics.request_latency.observe(now - served.arrival_time)
