"""The grammar process's side: it compiles one engine's structured-output specs, keeps
their matchers and computes their masks, in a process of its own at a lower priority
(``engine/grammar_process.py`` starts it and is the engine's side).

Why a process: llguidance drops the GIL while it computes, but the Python around its
calls takes it back, and a thread at the lowest priority may be preempted while it holds
it. The engine's thread then waits for a thread the OS barely runs: gaps of 5-40 ms
beside the demo model's 1.4 ms steps. Here the engine's GIL is its own.

Messages come in order, as length-prefixed pickles (``engine/grammar_messages.py``):
``compile`` goes to the compiler's threads, the rest run one by one in the thread that
reads them, so a matcher's accepts and masks happen in the order the engine sent them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
import threading
import time
from pathlib import Path

import llguidance

from updraft.engine.grammar_compiler import GrammarCompiler, plain_error
from updraft.engine.grammar_messages import BROKEN, COMPLETE, MaskReply, read_message, write_message
from updraft.runner.side_threads import LOWER_BY

# A forbidden draft ends the masks: the rows past it are left all ones (not computed).
ALL_ONES = 0xFF


class GrammarWorker:
    """The matchers of one engine's constrained requests, by the handle the engine gave
    each when it asked for its compile."""

    def __init__(self, connection: socket.socket, compiler: GrammarCompiler) -> None:
        self._connection = connection
        self._compiler = compiler
        self._words = -(-compiler.vocab_size // 32)
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._executor = llguidance.LLExecutor(1)
        self._send_lock = threading.Lock()

    def serve(self) -> None:
        """Run messages until the engine closes its end. One thread reads and runs them,
        so a message costs one wake-up of this low-priority process; the engine's side
        never blocks on a full socket (it keeps what does not fit)."""
        try:
            while (message := read_message(self._connection)) is not None:
                kind, *args = message
                if kind == "compile":
                    self._compile(*args)
                elif kind == "accept":
                    self._accept(*args)
                elif kind == "mask":
                    self._mask(*args)
                elif kind == "remove":
                    self._matchers.pop(args[0], None)
        finally:
            self._compiler.close()

    def _reply(self, message: tuple) -> None:
        with self._send_lock:
            write_message(self._connection, message)

    def _compile(self, handle: int, key: tuple[str, str]) -> None:
        future = self._compiler.submit_key(key)

        def done(_) -> None:
            try:
                self._matchers[handle] = future.result()
                error = None
            except ValueError as failed:  # a GrammarError, or a tokenizer it cannot read
                error = str(failed)
            except Exception as failed:
                error = repr(failed)
            self._reply(("compiled", handle, error))

        future.add_done_callback(done)

    def _accept(self, appended: list[tuple[int, list[int]]]) -> None:
        """Advance matchers over the tokens their requests appended; tell the engine of
        each that completed or broke (masks keep every other outcome away)."""
        for handle, tokens in appended:
            matcher = self._matchers.get(handle)
            if matcher is None or matcher.is_stopped() or matcher.is_error():
                continue
            # A matcher in error is stopped too: the error is asked first.
            if not matcher.consume_tokens(tokens) or matcher.is_error():
                message = plain_error(matcher.get_error()) or "a token the grammar forbids"
                self._reply(("verdict", handle, BROKEN, message))
            elif matcher.is_stopped():
                self._reply(("verdict", handle, COMPLETE, None))

    def _mask(self, job: int, handle: int, drafts: list[int]) -> None:
        start = time.thread_time()  # the mask's CPU time (see MASK_SECONDS_LIMIT)
        reply = self._compute(handle, drafts)
        reply.seconds = time.thread_time() - start
        self._reply(("mask", job, reply))

    def _compute(self, handle: int, drafts: list[int]) -> MaskReply:
        """The masks at the matcher's state and after each draft, or the verdict of a
        matcher that has completed or broken."""
        matcher = self._matchers.get(handle)
        if matcher is None:
            return MaskReply(error="its grammar is gone")
        if matcher.is_error():  # before is_stopped, which an error sets too
            return MaskReply(verdict=BROKEN, error=plain_error(matcher.get_error()))
        if matcher.is_stopped():
            return MaskReply(verdict=COMPLETE)
        rows = 1 + len(drafts)
        bitmask = bytearray([ALL_ONES]) * (rows * self._words * 4)
        pointer = ctypes.addressof((ctypes.c_char * len(bitmask)).from_buffer(bitmask))
        try:
            if drafts:  # llguidance's call for drafts takes only rows that have some
                self._executor.unsafe_compute_mask_ptr_with_draft_token(
                    [(matcher, 0, drafts)], pointer, self._words * 4, rows
                )
            else:
                self._executor.unsafe_compute_mask_ptr([(matcher, 0)], pointer, self._words * 4, 1)
        except Exception as error:
            return MaskReply(error=f"its mask could not be computed: {error}")
        return MaskReply(bitmask=bytes(bitmask), stops_after=_stops_after(matcher, drafts))


def _stops_after(matcher: llguidance.LLMatcher, drafts: list[int]) -> int | None:
    """After how many of ``drafts`` the grammar is complete, if it is within them: the
    engine ends a request there when its step accepts them, as it would token by token."""
    valid = matcher.validate_tokens(drafts) if drafts else 0
    if not valid:
        return None
    probe = matcher.deep_copy()
    for count, token in enumerate(drafts[:valid], start=1):
        probe.consume_token(token)
        if probe.is_stopped() and not probe.is_error():
            return count
    return None


def lower_priority() -> None:
    """Run, from here on in every thread this one starts, ``LOWER_BY`` nice values below
    the steps (about 1.5% of a contended core against one of their threads). Linux's
    idle policy measured the same beside the demo model's steps; a process at it gets
    a fifth of that share when another process keeps the cores busy, and a step may be
    waiting for its masks."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or forbidden
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + LOWER_BY)


def main(argv: list[str]) -> None:
    """``python -m updraft.engine.grammar_worker FD TOKENIZER_JSON VOCAB_SIZE EOS_IDS``."""
    descriptor, tokenizer_json, vocab_size, eos = argv
    lower_priority()
    eos_ids = tuple(int(token) for token in eos.split(",") if token)
    compiler = GrammarCompiler(Path(tokenizer_json), int(vocab_size), eos_ids)
    connection = socket.socket(fileno=int(descriptor))
    GrammarWorker(connection, compiler).serve()
    # Nothing here is wanted once the engine has gone: not a compile or a mask still
    # running, which the interpreter's exit would wait for.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
