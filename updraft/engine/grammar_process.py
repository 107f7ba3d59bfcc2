"""The engine's side of its grammar process (``engine/grammar_worker.py``), which
compiles specs, keeps the matchers and computes the masks.

The process starts with the first spec to compile. It is sent work and never waited for
but where a caller says how long: replies are read in the engine's thread, in ``poll``,
and each resolves the future of the compile or mask it answers or records a verdict.
This side's socket does not block: what does not fit waits and goes at the next call,
so a grammar process starved of CPU never holds a step.

If the process dies, what was pending fails with a message, the requests whose matchers
it held end with an error at their next mask, and the next compile starts a new one.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from concurrent.futures import Future
from pathlib import Path

from updraft.engine.grammar_compiler import model_vocabulary
from updraft.engine.grammar_messages import MaskReply, MessageBuffer, frame
from updraft.tokenizer import Tokenizer

GONE = "the grammar process exited"
CLOSE_SECONDS = 5.0


class GrammarProcess:
    """Specs for one tokenizer (a checkpoint's ``tokenizer.json``) whose tokens are the
    first of the model's ``vocab_size`` logits; ``eos_token_ids`` end a constrained
    output where its grammar is complete."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words in a mask row
        eos = ",".join(str(token) for token in eos_token_ids)
        self._arguments = [str(tokenizer_json), str(vocab_size), eos]
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._out = bytearray()
        self._in = MessageBuffer()
        self._handles = itertools.count()
        self._jobs = itertools.count()
        self._live: set[int] = set()  # handles of matchers the running process holds
        self._compiles: dict[int, Future[int]] = {}
        self._masks: dict[int, Future[MaskReply]] = {}
        # Masks whose grammar the process has found costly: not worth a step's wait.
        self.slow_masks: set[Future[MaskReply]] = set()
        self.num_slow_masks = 0  # over the engine's life
        # Matchers an accept completed or broke: handle -> (verdict, message).
        self.verdicts: dict[int, tuple[str, str | None]] = {}

    @classmethod
    def for_model(
        cls, model: str, vocab_size: int, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...]
    ) -> GrammarProcess:
        """The process for a checkpoint's tokenizer (``model_vocabulary``)."""
        return cls(*model_vocabulary(model, vocab_size, tokenizer), eos_token_ids)

    @property
    def pid(self) -> int | None:
        """The running process's id (None before the first compile, or once it died)."""
        return None if self._socket is None else self._process.pid

    # -- requests ----------------------------------------------------------------------

    def compile(self, key: tuple[str, str]) -> Future[int]:
        """A matcher for the spec with ``key``; the future gives its handle, or raises
        ``ValueError`` with the compiler's message. Cancel it to drop the matcher."""
        self._start()
        handle = next(self._handles)
        future: Future[int] = Future()
        self._compiles[handle] = future
        self._send(("compile", handle, key))
        return future

    def accept(self, appended: list[tuple[int, list[int]]]) -> None:
        """Advance matchers over the tokens their requests appended, in order."""
        appended = [(handle, tokens) for handle, tokens in appended if handle in self._live]
        if appended:
            self._send(("accept", appended))

    def mask(self, handle: int, drafts: list[int]) -> Future[MaskReply]:
        """The masks at the matcher's state, then after each of ``drafts``."""
        future: Future[MaskReply] = Future()
        if handle not in self._live:
            future.set_result(MaskReply(error=GONE))
            return future
        job = next(self._jobs)
        self._masks[job] = future
        self._send(("mask", job, handle, list(drafts)))
        return future

    def remove(self, handle: int) -> None:
        self.verdicts.pop(handle, None)
        if handle in self._live:
            self._live.discard(handle)
            self._send(("remove", handle))

    # -- replies -----------------------------------------------------------------------

    def poll(self, timeout: float | None = 0.0) -> None:
        """Send what waits and read what has come, waiting up to ``timeout`` (None: no
        limit) for either to be possible."""
        if self._socket is None:
            return
        writing = [self._socket] if self._out else []
        readable, writable, _ = select.select([self._socket], writing, [], timeout)
        if writable:
            self._flush()
        if readable and self._socket is not None:
            self._read()

    def wait(
        self, pending: Collection[Future], timeout: float | None, or_slow: bool = False
    ) -> None:
        """Until one of ``pending`` is done (``or_slow``: or found slow), or ``timeout``
        has passed (None: no limit)."""
        deadline = None if timeout is None else time.perf_counter() + timeout

        def over(future: Future) -> bool:
            return future.done() or (or_slow and future in self.slow_masks)

        while not any(over(future) for future in pending) and self._socket is not None:
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                return
            self.poll(left)

    def close(self) -> None:
        """End the process (it exits once its socket closes)."""
        if self._socket is None:
            return
        process = self._process
        self._died()
        try:
            process.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    # -- the process -------------------------------------------------------------------

    def _start(self) -> None:
        if self._socket is not None:
            return
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])  # where updraft is
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            part for part in (package_root, environment.get("PYTHONPATH")) if part
        )
        with theirs:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "updraft.engine.grammar_worker",
                    str(theirs.fileno()),
                    *self._arguments,
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=environment,
            )
        ours.setblocking(False)
        self._socket = ours

    def _send(self, message: tuple) -> None:
        self._out += frame(message)
        self._flush()

    def _flush(self) -> None:
        while self._out and self._socket is not None:
            try:
                sent = self._socket.send(self._out)
            except BlockingIOError:
                return
            except OSError:
                self._died()
                return
            del self._out[:sent]

    def _read(self) -> None:
        while self._socket is not None:
            try:
                data = self._socket.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._died()
                return
            for message in self._in.feed(data):
                self._dispatch(message)

    def _dispatch(self, message: tuple) -> None:
        kind, key, *rest = message
        if kind == "compiled":
            future, error = self._compiles.pop(key, None), rest[0]
            if error is not None:
                if future is not None and not future.cancelled():
                    future.set_exception(ValueError(error))
                return
            self._live.add(key)
            if future is None or not future.set_running_or_notify_cancel():
                self.remove(key)  # its request was aborted while it compiled
            else:
                future.set_result(key)
        elif kind == "verdict":
            if key in self._live:
                self.verdicts[key] = (rest[0], rest[1])
        elif kind == "mask":
            future = self._masks.pop(key, None)
            if future is not None:
                self.slow_masks.discard(future)
                future.set_result(rest[0])
        elif kind == "slow":
            future = self._masks.get(key)
            if future is not None:
                self.slow_masks.add(future)
            self.num_slow_masks += 1

    def _died(self) -> None:
        """The process has exited (or is being closed): everything pending fails."""
        if self._socket is not None:
            self._socket.close()
        self._socket, self._out, self._in = None, bytearray(), MessageBuffer()
        self._live.clear()
        self.verdicts.clear()
        compiles, self._compiles = self._compiles, {}
        masks, self._masks = self._masks, {}
        self.slow_masks.clear()
        for future in compiles.values():
            if not future.cancelled():
                future.set_exception(ValueError(f"structured_outputs: {GONE}"))
        for future in masks.values():
            future.set_result(MaskReply(error=GONE))
