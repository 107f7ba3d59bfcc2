"""One step's grammar masks, computed per constrained request in the grammar process and
taken by the runner only as far as they are ready.

A grammar's mask usually costs well under a millisecond, but llguidance may take far
longer for one state (a lexer that builds many regex derivatives: a first mask of up
to a second, or 15 ms at every token of a grammar at its per-step fuel limit). The step
never waits for such a mask: after the forward the runner waits only while masks keep
finishing, each within ``mask_wait`` (``runner/token_mask.py``) of the last and all
within the forward's time (and never for one the grammar process has said is costly:
``QUICK_MASK_SECONDS``), takes the masks that are done, and leaves the late
requests' rows unmasked. Their tokens are dropped (``Grammars.is_late``), their last
token is counted as not computed, and they wait out of the batch until their mask is
done; they rejoin with it (``MaskJob.cached``), so a slow grammar still advances a token
per mask. A job that finds its grammar complete or broken (by the tokens the step before
appended) answers with that verdict instead, and its request is treated as late too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from updraft.engine.grammar_messages import MaskReply
from updraft.engine.grammar_process import GrammarProcess
from updraft.step.allowed_tokens import AllowedTokens


@dataclass
class MaskJob:
    """The masks of one request's rows: at its state, then after each of ``drafts``."""

    request_id: str
    index: int  # the request's among the step's sampling requests
    handle: int  # its matcher's, in the grammar process
    rows: list[int]  # the step's logits rows it masks, in order
    drafts: list[int]
    words: int  # int32 words per row
    cached: torch.Tensor | None = None  # its mask, computed while it waited out a step
    slow: bool = False  # its grammar's last mask was late
    reply: MaskReply | None = None  # once done

    def submit(self, process: GrammarProcess) -> Future[MaskReply]:
        if self.cached is not None and not self.drafts:
            future: Future[MaskReply] = Future()
            future.set_result(MaskReply(seconds=0.0))
            return future
        return process.mask(self.handle, self.drafts)

    def take(self, reply: MaskReply) -> None:
        self.reply = reply

    @property
    def usable(self) -> bool:
        """Done, with masks (not a verdict or an error)."""
        reply = self.reply
        return reply is not None and reply.error is None and reply.verdict is None

    @property
    def bitmask(self) -> torch.Tensor:
        """[len(rows), words] int32."""
        if self.reply.bitmask is None:
            return self.cached
        data = torch.frombuffer(bytearray(self.reply.bitmask), dtype=torch.int32)
        return data.view(len(self.rows), self.words)


class StepMasks:
    """A step's mask jobs, sent at once (``overlap``: computed while the forward runs)
    or when the runner first asks (after the forward). ``ready`` hands the runner the
    masks of the jobs done in time and ``on_ready`` the jobs, done and late (with the
    futures of the late)."""

    def __init__(
        self,
        jobs: list[MaskJob],
        process: GrammarProcess,
        on_ready: Callable[[list[MaskJob], list[tuple[MaskJob, Future]]], None],
        overlap: bool,
        defer: bool,
    ) -> None:
        self._jobs = jobs
        self._process = process
        self._on_ready = on_ready
        self._defer = defer
        self._overlap = overlap
        self._futures: list[Future[MaskReply]] | None = None
        if overlap:
            self._start()

    def _start(self) -> list[Future[MaskReply]]:
        if self._futures is None:
            self._futures = [job.submit(self._process) for job in self._jobs]
        return self._futures

    def ready(self, quiet: float, limit: float) -> AllowedTokens | None:
        """The masks done before ``quiet`` seconds pass without one finishing, and
        within ``limit`` in all (every one, however long it takes, when late requests
        cannot wait out of the batch): a batch of quick masks is waited for whole, a
        stalled one is not. With ``overlap``, a grammar whose last mask was late is not
        waited for at all (its mask is taken if the forward's time was enough): its
        every mask would otherwise cost every stream a wait."""
        skip_slow = self._defer and self._overlap
        waited = [
            future
            for job, future in zip(self._jobs, self._start(), strict=True)
            if not (skip_slow and job.slow)
        ]
        slow = self._process.slow_masks if self._defer else ()

        def waiting(future: Future) -> bool:
            return not future.done() and future not in slow

        pending = [future for future in waited if waiting(future)]
        deadline = time.perf_counter() + limit
        while pending:
            left = deadline - time.perf_counter()
            if self._defer and left <= 0:
                break
            self._process.wait(pending, min(quiet, left) if self._defer else None, self._defer)
            still = [future for future in pending if waiting(future)]
            if len(still) == len(pending):
                break  # none finished within ``quiet``, or the process is gone
            pending = still
        done, late = [], []
        for job, future in zip(self._jobs, self._futures, strict=True):
            if future.done():
                job.take(future.result())
            if job.usable:
                done.append(job)
            else:
                late.append((job, future))
        self._on_ready(done, late)
        rows = torch.tensor([row for job in done for row in job.rows], dtype=torch.long)
        words = self._jobs[0].words
        bitmask = torch.cat([torch.empty(0, words, dtype=torch.int32)] + [j.bitmask for j in done])
        return AllowedTokens(rows, bitmask, tuple(job.index for job, _ in late))
