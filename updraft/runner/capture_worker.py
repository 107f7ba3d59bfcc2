"""Captured buckets made while the engine already runs: in a thread beside the steps.

Capturing every bucket and compiling its runs with inductor takes from seconds (a warm
compile cache) to minutes (a cold one on a busy machine); a fresh engine should answer
its first request long before. So the runner starts with no graph at all and steps
eagerly, while this worker, in a thread of its own:

1. captures each bucket as recorded ops, replayed op by op (``RecordedGraph`` with
   ``defer_compile``), smallest decode bucket first;
2. then compiles each bucket's runs (``RecordedGraph.compile``, which reads only the
   recorded ops' shapes, never a tensor's values, so it runs beside the steps).

It hands each result to the runner's thread (``handed``), which takes it between two
steps (``CapturedSteps.take_ready``): a captured bucket is replayed from the next step
that fits it, a compiled one replaces its op-by-op replay. A capture writes the static
input buffers the buckets share, so it holds ``lock``, and no step replays meanwhile
(those steps run eagerly). Compiled and op-by-op replays compute the same ops, so the
swap changes no greedy token.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any, NamedTuple

import torch

from updraft.graph.compile_cache import compiling, open_cache, seal

logger = logging.getLogger(__name__)

# Workers whose thread may still run. A daemon thread still inside torch's C++ when the
# interpreter finalizes is unwound by force, which aborts the process ("terminate called
# without an active exception"); so at exit each stops after the bucket in hand, and is
# waited for.
_running: weakref.WeakSet[CaptureWorker] = weakref.WeakSet()


@atexit.register
def _stop_every_worker() -> None:
    for worker in list(_running):
        worker.stop()
        worker.thread.join()


class Handed(NamedTuple):
    """What the worker made: ("captured", bucket, Captured), ("compiled", bucket,
    segments), ("failed", None, the error) or ("done", None, seconds)."""

    kind: str
    bucket: Any
    value: Any


class CaptureWorker:
    def __init__(
        self,
        capture: Callable[[Any], Any],
        buckets: list[Any],
        compile_runs: bool,
        lock: threading.Lock,
        owner: str,
    ) -> None:
        """``capture(bucket)``: the bucket's ``Captured``, its runs uncompiled."""
        self.capture, self.buckets = capture, buckets
        self.compile_runs, self.lock, self.owner = compile_runs, lock, owner
        self.handed: SimpleQueue[Handed] = SimpleQueue()
        self.finished = False
        self.stopping = threading.Event()
        self.started = time.perf_counter()
        self.thread = threading.Thread(
            target=self._work, name=f"updraft-{owner}-graphs", daemon=True
        )
        _running.add(self)
        self.thread.start()

    def take(self) -> list[Handed]:
        """Everything handed over since the last call (the runner's thread)."""
        taken = []
        while True:
            try:
                taken.append(self.handed.get_nowait())
            except Empty:
                return taken

    def stop(self) -> None:
        """No more buckets after the one in hand (an engine that closes: not waited for,
        so a short run's exit is not held up by a compile)."""
        self.stopping.set()

    def _work(self) -> None:
        try:
            with torch.inference_mode():
                captured = self._capture_all()
                if self.compile_runs and not self.stopping.is_set():
                    self.compile_all(captured)
        except Exception as error:
            self.handed.put(Handed("failed", None, error))
        # The capture function is the steps' own: held past here, it would make a cycle
        # that only the cycle collector frees.
        self.capture = None
        self.handed.put(Handed("done", None, time.perf_counter() - self.started))

    def _capture_all(self) -> dict[Any, Any]:
        logger.info(
            "%s: capturing %d graph buckets in the background; steps run eagerly until each "
            "is ready",
            self.owner,
            len(self.buckets),
        )
        captured = {}
        for bucket in self.buckets:
            if self.stopping.is_set():
                break
            with self.lock:
                captured[bucket] = self.capture(bucket)
            self.handed.put(Handed("captured", bucket, captured[bucket]))
        logger.info(
            "%s: %d buckets captured in %.1f s%s",
            self.owner,
            len(captured),
            time.perf_counter() - self.started,
            "; compiling their runs in the background" if self.compile_runs else "",
        )
        return captured

    def compile_all(self, captured: dict[Any, Any]) -> None:
        folder = open_cache()
        with compiling(folder):
            self._compile_each(captured, folder)

    def _compile_each(self, captured: dict[Any, Any], folder: Any) -> None:
        for bucket, graph in captured.items():
            if self.stopping.is_set():
                return
            self.handed.put(Handed("compiled", bucket, graph.graph.backend.compile()))
            if folder is not None:  # what is compiled so far, for a start cut short
                seal(folder)
