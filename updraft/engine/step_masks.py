"""One step's grammar masks, computed per constrained request in the mask thread and
taken by the runner only as far as they are ready.

A grammar's mask usually costs well under a millisecond, but llguidance may take far
longer for one state (a lexer that builds many regex derivatives: a first mask of up
to a second, or 15 ms at every token of a grammar at its per-step fuel limit). The step
never waits for such a mask: after the forward the runner waits only while masks keep
finishing, each within ``mask_wait`` (``runner/token_mask.py``) of the last and all
within the forward's time, takes the masks that are done, and leaves the late
requests' rows unmasked. Their tokens are
dropped (``Grammars.is_late``), their last token is counted as not computed, and they
wait out of the batch until their mask is done; they rejoin with it
(``MaskJob.cached``), so a slow grammar still advances a token per mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from updraft.step.allowed_tokens import AllowedTokens


@dataclass
class MaskJob:
    """The masks of one request's rows: at its state, then after each of ``drafts``."""

    request_id: str
    index: int  # the request's among the step's sampling requests
    matcher: llguidance.LLMatcher
    rows: list[int]  # the step's logits rows it masks, in order
    drafts: list[int]
    words: int  # int32 words per row
    cached: torch.Tensor | None = None  # its mask, computed while it waited out a step
    bitmask: torch.Tensor | None = None  # [len(rows), words], once run
    seconds: float = 0.0
    error: str | None = None

    def run(self, executor: llguidance.LLExecutor) -> None:
        start = time.thread_time()  # the mask's CPU time (see MASK_SECONDS_LIMIT)
        if self.cached is not None and not self.drafts:
            self.bitmask = self.cached
            return
        # All ones: a row past a draft the grammar forbids is left as it is.
        bitmask = torch.full((len(self.rows), self.words), -1, dtype=torch.int32)
        pointer, row_bytes = bitmask.data_ptr(), self.words * 4
        try:
            if self.drafts:  # llguidance's call for drafts takes only rows that have some
                executor.unsafe_compute_mask_ptr_with_draft_token(
                    [(self.matcher, 0, self.drafts)], pointer, row_bytes, len(self.rows)
                )
            else:
                executor.unsafe_compute_mask_ptr([(self.matcher, 0)], pointer, row_bytes, 1)
        except Exception as error:  # the request fails, not the step
            self.error = f"its mask could not be computed: {error}"
        self.seconds = time.thread_time() - start
        self.bitmask = bitmask


class StepMasks:
    """A step's mask jobs, started at once (``overlap``: while the forward runs) or when
    the runner first asks (after the forward). ``ready`` hands the runner the masks of
    the jobs done in time and ``on_late`` the rest, with their futures."""

    def __init__(
        self,
        jobs: list[MaskJob],
        thread: ThreadPoolExecutor,
        executor: llguidance.LLExecutor,
        on_late: Callable[[list[tuple[MaskJob, Future]]], None],
        overlap: bool,
        defer: bool,
    ) -> None:
        self._jobs = jobs
        self._thread = thread
        self._executor = executor
        self._on_late = on_late
        self._defer = defer
        self._futures: list[Future] | None = None
        if overlap:
            self._start()

    def _start(self) -> list[Future]:
        if self._futures is None:
            self._futures = [self._thread.submit(job.run, self._executor) for job in self._jobs]
        return self._futures

    def ready(self, quiet: float, limit: float) -> AllowedTokens | None:
        """The masks done before ``quiet`` seconds pass without one finishing, and
        within ``limit`` in all (every one, however long it takes, when late requests
        cannot wait out of the batch): a batch of quick masks is waited for whole, a
        stalled one is not."""
        pending = set(self._start())
        deadline = time.perf_counter() + limit
        while pending:
            left = deadline - time.perf_counter()
            if self._defer and left <= 0:
                break
            timeout = min(quiet, left) if self._defer else None
            done, pending = futures.wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            if not done:
                break
        done, late = [], []
        for job, future in zip(self._jobs, self._futures, strict=True):
            if future.done() and job.error is None:
                done.append(job)
            else:
                late.append((job, future))
        if late:
            self._on_late(late)
        rows = torch.tensor([row for job in done for row in job.rows], dtype=torch.long)
        words = self._jobs[0].words
        bitmask = torch.cat([torch.empty(0, words, dtype=torch.int32)] + [j.bitmask for j in done])
        return AllowedTokens(rows, bitmask, tuple(job.index for job, _ in late))
