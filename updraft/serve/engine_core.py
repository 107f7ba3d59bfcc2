"""The engine core: one loop that owns the engine, fed by every API process.

``updraft serve`` runs it in a process of its own, so nothing an API process does (parse
JSON, tokenize a huge prompt, render a chat template, decode text) holds the GIL the
engine steps under; tests run the same loop in a thread beside the server. Either way
the API side talks to it only through ZeroMQ sockets (serve/wire.py):

* one PULL socket takes the adds, aborts and the shutdown of every API process;
* one PUSH socket per API process carries its requests' outputs and the engine's stats.

Sends never block (no high-water mark): the engine never waits on an API process. Adds
and aborts are applied between steps, all that have arrived at once; an add whose abort
arrived with it never reaches the engine. An add is a request the API process's intake
finished (engine/input_processor.py), which the engine queues as it is. The engine does
not decode text for these requests: detokenizing and stop strings are the API process's
(serve/served_request.py), which stops a sequence its stop string has ended.

An API process that dies (killed, crashed) is reported by the process supervising them
("client_gone"): the core aborts every request it added, which frees their KV blocks,
and sends it nothing more (what it had queued for it is dropped) until a process in its
place says "hello".
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from updraft.config import EngineConfig
from updraft.engine.families import child_id
from updraft.engine.input_processor import ModelLimits
from updraft.serve import wire
from updraft.serve.core_addresses import CoreAddresses

if TYPE_CHECKING:  # the API side imports this module, and never loads torch
    from updraft.engine.engine import Engine

logger = logging.getLogger("updraft.serve")

# While idle, how often the loop looks whether the process that started it is gone.
IDLE_POLL_MS = 500
# How long a core thread told to stop may take (it finishes its step).
JOIN_SECONDS = 30


# What an API process needs to know of the engine it serves, sent once it is up: what
# its intake checks requests against.
EngineInfo = ModelLimits


def engine_info(engine: Engine) -> EngineInfo:
    return engine.input_processor.limits


class EngineCore:
    def __init__(self, engine: Engine, addresses: CoreAddresses) -> None:
        self.engine = engine
        self.context = zmq.Context()
        self.input = wire.pull_socket(self.context, addresses.input)
        self.addresses = addresses
        self.outputs = [wire.push_socket(self.context, a) for a in addresses.outputs]
        self._gone: set[int] = set()  # API processes that died, until one takes their place
        self._client_of: dict[str, int] = {}  # running request -> its API process
        self._num_sequences: dict[str, int] = {}  # running request -> its n
        self._applied: list[list[str]] = [[] for _ in self.outputs]
        self._aborted: list[list[str]] = [[] for _ in self.outputs]

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> bool:
        """Step until a shutdown arrives (or ``keep_going`` says no while idle); False
        after an error, which is logged and told to every API process."""
        graphs_ready = False
        try:
            while True:
                busy = self.engine.has_unfinished
                if not busy and not graphs_ready:  # swapped in while idle too
                    graphs_ready = self.engine.graphs_ready()
                if self.input.poll(0 if busy else IDLE_POLL_MS) and not self._apply_commands():
                    self._abort_all()
                    return True
                outputs = self.engine.step() if self.engine.has_unfinished else []
                if outputs or busy or any(self._applied) or any(self._aborted):
                    self._send(outputs)
                if not busy and not self.engine.has_unfinished and not keep_going():
                    return True
        except Exception as error:
            logger.exception("the engine core failed; failing every request")
            for socket in self.outputs:
                socket.send(
                    wire.pack(["failed", f"the engine loop failed: {error!r}"]), zmq.NOBLOCK
                )
            return False
        finally:
            for socket in (self.input, *self.outputs):
                socket.close(linger=0)
            self.context.term()

    def _apply_commands(self) -> bool:
        """Apply every command that has arrived; False on a shutdown."""
        commands = []
        while True:
            try:
                commands.append(wire.unpack(self.input.recv(zmq.NOBLOCK)))
            except zmq.Again:
                break
        aborted = {rid for c in commands if c[0] == "abort" for rid in c[2]}
        for command in commands:
            kind = command[0]
            if kind == "shutdown":
                return False
            if kind == "add":
                gone = command[1] in self._gone  # sent before its process died
                self._add(*command[1:], skip=command[2] in aborted or gone)
            elif kind == "abort":
                client, request_ids = command[1:]
                self._aborted[client] += request_ids
                for request_id in request_ids:
                    self._abort(request_id)
            elif kind == "stop":
                for request_id, index in command[1]:
                    self._stop(request_id, index)
            elif kind == "client_gone":
                self._client_gone(command[1])
            elif kind == "hello":
                self._gone.discard(command[1])
        return True

    def _client_gone(self, client: int) -> None:
        """API process ``client`` died: abort what it added, and drop what was queued
        for it (a socket in the old one's place, connected to the same address)."""
        for request_id in [r for r, c in self._client_of.items() if c == client]:
            self._abort(request_id)
        self._applied[client] = []
        self._aborted[client] = []
        self._gone.add(client)
        self.outputs[client].close(linger=0)
        self.outputs[client] = wire.push_socket(self.context, self.addresses.outputs[client])

    def _abort_all(self) -> None:
        """Leave the engine with nothing running (an engine in this process may serve
        again): every request still held is aborted, and their last outputs dropped."""
        for request_id in list(self._client_of):
            self._abort(request_id)
        while self.engine.has_unfinished:
            self.engine.step()

    def _abort(self, request_id: str) -> None:
        if self._client_of.pop(request_id, None) is not None:
            del self._num_sequences[request_id]
            self.engine.abort(request_id)

    def _stop(self, request_id: str, index: int) -> None:
        """A stop string ended sequence ``index``: the engine stops computing it. Its
        request stays the client's until its last sequence ends."""
        n = self._num_sequences.get(request_id)
        if n is None:
            return
        if n == 1:
            self._abort(request_id)
        else:
            self.engine.abort(child_id(request_id, index))

    def _add(self, client: int, request_id: str, *fields, skip: bool) -> None:
        self._applied[client].append(request_id)
        if skip:  # its client left before the engine saw it
            return
        try:
            intake = wire.request_from_wire(*fields)
            params = intake.params
            self.engine.add(intake, request_id, detokenize=False)
        except Exception as error:  # a bad request must not stop the loop
            logger.exception("cannot add request %s", request_id)
            self._fail_request(client, request_id, error)
            return
        self._client_of[request_id] = client
        self._num_sequences[request_id] = params.n

    def _fail_request(self, client: int, request_id: str, error: Exception) -> None:
        delta = wire.SequenceDelta(
            request_id, 0, [], None, None, "error", None, str(error), None, None, None, 0, None
        )
        self.outputs[client].send(wire.pack(["step", [delta], self._stats(), [], []]))

    def _send(self, outputs: list) -> None:
        by_client: list[list[wire.SequenceDelta]] = [[] for _ in self.outputs]
        for output in outputs:
            client = self._client_of.get(output.request_id)
            if client is None:  # aborted: its API process no longer listens
                continue
            completion = output.outputs[0]
            first_with_tokens = output.metrics.num_output_tokens == len(
                completion.delta_token_ids
            ) and bool(completion.delta_token_ids or completion.finish_reason)
            by_client[client].append(wire.delta_of(output, first_with_tokens))
            if output.finished:
                del self._client_of[output.request_id], self._num_sequences[output.request_id]
        stats = self._stats()
        for client, socket in enumerate(self.outputs):
            if client in self._gone:
                continue
            socket.send(
                wire.pack(
                    ["step", by_client[client], stats, self._applied[client], self._aborted[client]]
                ),
                zmq.NOBLOCK,
            )
            self._applied[client] = []
            self._aborted[client] = []

    def _stats(self) -> wire.CoreStats:
        stats = self.engine.stats()
        speculative = stats.speculative
        return wire.CoreStats(
            stats.num_running,
            stats.num_waiting,
            stats.kv_blocks_used,
            stats.kv_blocks_total,
            [] if speculative is None else speculative.proposed,
            [] if speculative is None else speculative.accepted,
        )


class CoreThread:
    """The core over an engine already built, in a thread of this process (tests, and
    callers that hold an ``Engine``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.addresses = CoreAddresses.in_directory(tempfile.mkdtemp(prefix="updraft-core-"), 1)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        core = EngineCore(self.engine, self.addresses)  # bound before this returns
        self._thread = threading.Thread(target=core.run, name="updraft-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(JOIN_SECONDS)
        shutil.rmtree(self.addresses.directory, ignore_errors=True)


def run_core_process(
    config: EngineConfig,
    addresses: CoreAddresses,
    ready: multiprocessing.connection.Connection,
    parent: int,
) -> None:
    """The engine process: build the engine, say so over ``ready`` (its EngineInfo, or
    the error that stopped it), and serve until a shutdown arrives or the process that
    started this one, ``parent``, is gone (its pid is passed in: read here, it could
    already be init's)."""
    # Ctrl-C reaches the whole process group: the API process drains, then says when.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Its progress (graphs captured and compiled after the start) shows as the server's.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("updraft").setLevel(logging.INFO)
    # torch loads here, in the engine process only: the server's own process started
    # this one before it loaded anything heavy, and never loads torch.
    from updraft.engine.engine import Engine

    try:
        engine = Engine(config)
    except Exception as error:
        ready.send(("error", f"{type(error).__name__}: {error}"))
        return
    try:
        core = EngineCore(engine, addresses)
        ready.send(("ready", engine_info(engine)))
        ready.close()
        served = core.run(keep_going=lambda: os.getppid() == parent)
    finally:
        engine.close()
    if os.getppid() != parent:  # killed outright, the parent left its sockets behind
        shutil.rmtree(addresses.directory, ignore_errors=True)
    if not served:
        raise SystemExit(1)
