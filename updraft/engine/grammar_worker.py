"""The grammar process's side: it compiles one engine's structured-output specs, keeps
their matchers and computes their masks, in a process of its own at the lowest priority
(``engine/grammar_process.py`` starts it and is the engine's side).

Why a process: llguidance drops the GIL while it computes, but the Python around its
calls takes it back, and a thread at the lowest priority may be preempted while it holds
it. The engine's thread then waits for a thread the OS barely runs: gaps of 5-40 ms
beside the demo model's 1.4 ms steps. Here the engine's GIL is its own.

Messages come in order, as length-prefixed pickles (``engine/grammar_messages.py``):
``compile`` goes to the compiler's threads, the rest run one by one in a single thread,
so a matcher's accepts and masks happen in the order the engine sent them. A reader
thread takes each message off the socket at once, so the engine's sends never fill it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

import llguidance

from updraft.engine.grammar_compiler import GrammarCompiler, GrammarError, plain_error
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
        self._work: queue.SimpleQueue = queue.SimpleQueue()

    def serve(self) -> None:
        """Read messages until the engine closes its end, then exit."""
        worker = threading.Thread(target=self._run_in_order, name="grammar-masks", daemon=True)
        worker.start()
        try:
            while (message := read_message(self._connection)) is not None:
                if message[0] == "compile":
                    self._compile(*message[1:])
                else:
                    self._work.put(message)
        finally:
            self._work.put(None)
            self._compiler.close()

    def _run_in_order(self) -> None:
        while (message := self._work.get()) is not None:
            kind, *args = message
            if kind == "accept":
                self._accept(*args)
            elif kind == "mask":
                self._mask(*args)
            elif kind == "remove":
                self._matchers.pop(args[0], None)

    def _reply(self, message: tuple) -> None:
        with self._send_lock:
            write_message(self._connection, message)

    def _compile(self, handle: int, key: tuple[str, str]) -> None:
        future = self._compiler.submit_key(key)

        def done(_) -> None:
            try:
                self._matchers[handle] = future.result()
                error = None
            except GrammarError as failed:
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


def lowest_priority() -> None:
    """Run, from here on in every thread this one starts, only where a core is free of
    the steps' threads: Linux's idle policy, which a waking thread of any other policy
    preempts at once. A lower nice value alone is not enough: the scheduler lets a
    nice 19 thread finish its slice of a few milliseconds, and the step threads' every
    barrier then waits for it (forwards of 50-130 ms beside 1.2 ms steps)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or a sandbox that forbids it
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + LOWER_BY)


def main(argv: list[str]) -> None:
    """``python -m updraft.engine.grammar_worker FD TOKENIZER_JSON VOCAB_SIZE EOS_IDS``."""
    descriptor, tokenizer_json, vocab_size, eos = argv
    lowest_priority()
    eos_ids = tuple(int(token) for token in eos.split(",") if token)
    compiler = GrammarCompiler(Path(tokenizer_json), int(vocab_size), eos_ids)
    connection = socket.socket(fileno=int(descriptor))
    GrammarWorker(connection, compiler).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
