"""The grammar process's side: it compiles one engine's structured-output specs, keeps
their matchers and computes their masks, in a process of its own
(``engine/grammar_process.py`` starts it and is the engine's side).

Why a process: llguidance drops the GIL while it computes, but the Python around its
calls takes it back, and a thread at a lower priority may be preempted while it holds
it. The engine's thread then waits for a thread the OS barely runs: gaps of 5-40 ms
beside the demo model's 1.4 ms steps. Here the engine's GIL is its own.

Two lanes, by what a grammar's masks cost. A mask usually takes well under a
millisecond, and a step may be waiting for it: it runs at the steps' own priority, in
the thread that reads the messages, so it gets a core as soon as another process's
thread would (at a lower priority, a process that kept the cores busy starved it: every
mask late, no draft ever verified). A watchdog lowers that thread by ``LOWER_BY`` nice
values once one mask has cost it ``QUICK_MASK_SECONDS`` of CPU, tells the engine not to
wait for it, and starts a new reader at the steps' priority; the costly grammar's later
messages go to the slow lane, a thread at the lower priority, until one of its masks
there is quick again. So a costly grammar takes from the steps at most that much CPU
before it yields to them (a Linux thread cannot raise its own priority back: the lowered
reader ends after its mask). Compiles run in the compiler's lower-priority threads.

Messages come in order, as length-prefixed pickles (``engine/grammar_messages.py``);
one matcher's accepts and masks run in the order the engine sent them.
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
from dataclasses import dataclass, field
from pathlib import Path

import llguidance

from updraft.engine.grammar_compiler import GrammarCompiler, plain_error
from updraft.engine.grammar_messages import BROKEN, COMPLETE, MaskReply, read_message, write_message
from updraft.runner.side_threads import LOWER_BY

# A forbidden draft ends the masks: the rows past it are left all ones (not computed).
ALL_ONES = 0xFF


# A mask that has cost its thread this much CPU moves its grammar to the slow lane:
# twice llguidance's p99 on a 128k vocabulary (0.5 ms), and no more than a 1-2 ms step
# can lose to it and still keep its gaps under twice their length.
QUICK_MASK_SECONDS = 0.001


@dataclass(eq=False)
class RunningMask:
    """The mask the reader thread is computing, as the watchdog sees it."""

    job: int
    handle: int
    native_id: int
    clock: int  # the thread's CPU clock
    start: float  # its reading when the mask began
    lowered: bool = False


@dataclass
class Lanes:
    """Which matchers' messages go to the slow lane, and how many of each wait there."""

    slow: set[int] = field(default_factory=set)
    queued: dict[int, int] = field(default_factory=dict)
    # Handles whose lowered reader still computes a mask: the slow lane waits for it.
    finishing: dict[int, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class GrammarWorker:
    """The matchers of one engine's constrained requests, by the handle the engine gave
    each when it asked for its compile."""

    def __init__(self, connection: socket.socket, compiler: GrammarCompiler) -> None:
        self._connection = connection
        self._compiler = compiler
        self._words = -(-compiler.vocab_size // 32)
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._send_lock = threading.Lock()
        self._lanes = Lanes()
        # (handle, message) for the slow lane, in the order the engine sent them.
        self._slow_queue: queue.SimpleQueue[tuple[int, tuple]] = queue.SimpleQueue()
        self._watched = threading.Condition()
        self._running: RunningMask | None = None
        self._closed = threading.Event()

    def serve(self) -> None:
        """Run messages until the engine closes its end."""
        for target in (self._watch, self._slow_lane, self._read):
            threading.Thread(target=target, daemon=True).start()
        self._closed.wait()
        self._compiler.close()

    def _read(self) -> None:
        """The reader: run each message of a quick grammar here, queue the rest for the
        slow lane. Returns when the engine has gone, or once the watchdog has lowered
        this thread (a new reader has taken over)."""
        executor = llguidance.LLExecutor(1)
        clock = time.pthread_getcpuclockid(threading.get_ident())
        while (message := read_message(self._connection)) is not None:
            kind, *args = message
            if kind == "compile":
                self._compile(*args)
            elif kind == "accept":
                quick = self._route_accept(args[0])
                if quick:
                    self._accept(quick)
            elif kind == "mask":
                if not self._route_one(args[1], message):
                    self._reply(("slow", args[0]))  # queued below the steps' priority
                elif self._mask_watched(executor, clock, *args):
                    return  # lowered: a new reader reads from here on
            elif kind == "remove" and self._route_one(args[0], message):
                self._matchers.pop(args[0], None)
        self._closed.set()

    def _route_accept(self, appended: list[tuple[int, list[int]]]) -> list:
        """The part of an accept for quick grammars; the rest goes to the slow lane."""
        quick = []
        with self._lanes.lock:
            for handle, tokens in appended:
                if handle in self._lanes.slow:
                    self._queue_slow(handle, ("accept", [(handle, tokens)]))
                else:
                    quick.append((handle, tokens))
        return quick

    def _route_one(self, handle: int, message: tuple) -> bool:
        """Whether the message is the reader's to run (else it went to the slow lane)."""
        with self._lanes.lock:
            if handle not in self._lanes.slow:
                return True
            self._queue_slow(handle, message)
        return False

    def _queue_slow(self, handle: int, message: tuple) -> None:
        """Queue a message for the slow lane and count it (the caller holds the lanes'
        lock)."""
        self._lanes.queued[handle] = self._lanes.queued.get(handle, 0) + 1
        self._slow_queue.put((handle, message))

    def _mask_watched(
        self, executor: llguidance.LLExecutor, clock: int, job: int, handle: int, drafts: list
    ) -> bool:
        """Compute a mask in the reader under the watchdog; whether it lowered us."""
        running = RunningMask(
            job, handle, threading.get_native_id(), clock, time.clock_gettime(clock)
        )
        with self._watched:
            self._running = running
            self._watched.notify()
        self._answer_mask(executor, job, handle, drafts)
        with self._watched:
            if self._running is running:  # (once lowered, a new reader's may be there)
                self._running = None
        if running.lowered:
            self._lanes.finishing.pop(handle).set()
        return running.lowered

    def _watch(self) -> None:
        """Lower the reader once its mask has cost ``QUICK_MASK_SECONDS`` of CPU (not of
        wall time: a reader that waits for a core on a busy machine costs the steps
        nothing), and start another at the steps' priority."""
        with self._watched:
            while True:
                while self._running is None:
                    self._watched.wait()
                running = self._running
                self._watched.wait(QUICK_MASK_SECONDS)
                if self._running is not running:
                    continue  # done, or the next mask has begun
                if time.clock_gettime(running.clock) - running.start < QUICK_MASK_SECONDS:
                    continue
                running.lowered = True
                _lower(running.native_id)
                with self._lanes.lock:
                    self._lanes.slow.add(running.handle)
                    self._lanes.finishing[running.handle] = threading.Event()
                self._reply(("slow", running.job))
                threading.Thread(target=self._read, daemon=True).start()
                self._running = None

    def _slow_lane(self) -> None:
        """Run the slow grammars' messages, at the lower priority. A grammar whose mask
        here is quick goes back to the reader once nothing of it waits here."""
        _lower(threading.get_native_id())
        executor = llguidance.LLExecutor(1)
        lanes = self._lanes
        while True:
            handle, (kind, *args) = self._slow_queue.get()
            finishing = lanes.finishing.get(handle)
            if finishing is not None:
                finishing.wait()
            quick = False  # an accept says nothing of what its grammar's masks cost
            if kind == "accept":
                self._accept(args[0])
            elif kind == "mask":
                job, _, drafts = args
                quick = self._answer_mask(executor, job, handle, drafts) < QUICK_MASK_SECONDS
            elif kind == "remove":
                self._matchers.pop(handle, None)
            with lanes.lock:
                lanes.queued[handle] -= 1
                if not lanes.queued[handle]:
                    del lanes.queued[handle]
                    if quick or kind == "remove":
                        lanes.slow.discard(handle)

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

    def _answer_mask(
        self, executor: llguidance.LLExecutor, job: int, handle: int, drafts: list[int]
    ) -> float:
        """Compute a mask job and send its reply; returns its CPU seconds in this thread
        (what ``MASK_SECONDS_LIMIT`` counts, and the watchdog reads from outside)."""
        start = time.thread_time()
        reply = self._compute(executor, handle, drafts)
        reply.seconds = time.thread_time() - start
        self._reply(("mask", job, reply))
        return reply.seconds

    def _compute(
        self, executor: llguidance.LLExecutor, handle: int, drafts: list[int]
    ) -> MaskReply:
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
                executor.unsafe_compute_mask_ptr_with_draft_token(
                    [(matcher, 0, drafts)], pointer, self._words * 4, rows
                )
            else:
                executor.unsafe_compute_mask_ptr([(matcher, 0)], pointer, self._words * 4, 1)
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


def _lower(native_id: int) -> None:
    """Run the thread ``LOWER_BY`` nice values below the steps (Linux: a thread's nice
    value is its own; elsewhere, or where it is forbidden, it keeps its priority)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, native_id, os.getpriority(os.PRIO_PROCESS, 0) + LOWER_BY)


def main(argv: list[str]) -> None:
    """``python -m updraft.engine.grammar_worker FD TOKENIZER_JSON VOCAB_SIZE EOS_IDS``."""
    descriptor, tokenizer_json, vocab_size, eos = argv
    eos_ids = tuple(int(token) for token in eos.split(",") if token)
    compiler = GrammarCompiler(Path(tokenizer_json), int(vocab_size), eos_ids)
    connection = socket.socket(fileno=int(descriptor))
    GrammarWorker(connection, compiler).serve()
    # Nothing here is wanted once the engine has gone: not a compile or a mask still
    # running, which the interpreter's exit would wait for.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
