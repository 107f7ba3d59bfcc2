"""The grammar state of every constrained request, and the masks of each step.

``Grammars`` is the one owner of that state: a request's matcher enters when its spec has
compiled, advances only through ``accept`` (the scheduler's update, with the tokens a
step appended: accepted drafts and one more), and leaves when the request ends. A
preempted request keeps its matcher, since its tokens stay; nothing of it lives on the
``Request``.

Each step, ``masks`` computes which tokens every constrained sampling row may take: at a
request's last known token, and after each of its drafts in turn (each mask from the
state the drafts before it lead to; past a draft the grammar forbids nothing is computed,
since verification stops there anyway). llguidance's executor drops the GIL, so with
``overlap`` the masks are computed in a thread while the forward runs. A mask that is
not ready in time never holds the step: its request waits out of the batch until it is
(``engine/step_masks.py``), and one slower than ``MASK_SECONDS_LIMIT`` ends it.

A grammar may start only after its request has written some tokens (a reasoning model's
end of reasoning: ``StructuredOutputsParams.starts_after``). Until then the request is
unconstrained and its matcher untouched; the gate that watches for them keeps only the
last few appended tokens, advanced by ``accept`` like the matcher, and a step's drafts
are read through it without changing it: a row's mask depends only on the tokens before
it, whether appended or drafted.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from updraft.engine.grammar_compiler import MASK_SECONDS_LIMIT, GrammarCompiler, plain_error
from updraft.engine.step_masks import MaskJob, StepMasks
from updraft.runner.side_threads import lower_priority
from updraft.step.allowed_tokens import AllowedTokens
from updraft.step.inputs import StepInputs


class Verdict(enum.Enum):
    GOING = "going"  # the output may go on
    COMPLETE = "complete"  # the grammar takes nothing more: the output is done
    BROKEN = "broken"  # a token the grammar forbids was appended (never by a masked row)


@dataclass
class Gate:
    """Waits for ``trigger`` in a request's output; ``tail`` holds the output's last
    tokens, as many as could begin the trigger."""

    trigger: tuple[int, ...]
    tail: tuple[int, ...] = ()

    def opened_by(self, tokens: Sequence[int]) -> int | None:
        """How many of ``tokens`` (following the output so far) it takes to complete the
        trigger, or None when they do not."""
        window = self.tail
        for count, token in enumerate(tokens, start=1):
            window = (*window, token)[-len(self.trigger) :]
            if window == self.trigger:
                return count
        return None

    def append(self, tokens: Sequence[int]) -> None:
        keep = len(self.trigger) - 1
        joined = (*self.tail, *tokens)
        self.tail = joined[len(joined) - keep :] if keep else ()


class Grammars:
    def __init__(self, compiler: GrammarCompiler, overlap: bool = True, defer: bool = True) -> None:
        self.compiler = compiler
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._gates: dict[str, Gate] = {}  # requests whose grammar has not started yet
        self._executor = llguidance.LLExecutor(1)
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="updraft-masks", initializer=lower_priority
        )
        self._overlap = overlap
        # Without it (a hybrid model, whose recurrent state cannot take a token back) a
        # step waits for every mask.
        self._defer = defer
        self._late: dict[str, tuple[MaskJob, Future]] = {}  # masks that missed their step
        self._cached: dict[str, torch.Tensor] = {}  # late masks done: [1, words] each
        self._slow: set[str] = set()  # requests that have had a late mask
        self.num_masked_rows = 0  # mask rows computed, over the engine's life
        self.num_late_masks = 0  # masks that missed their step

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def start(
        self, request_id: str, matcher: llguidance.LLMatcher, after: Sequence[int] = ()
    ) -> None:
        """Constrain ``request_id`` by ``matcher``, from the token after the output's
        first ``after`` on (at once if ``after`` is empty)."""
        self._matchers[request_id] = matcher
        if after:
            self._gates[request_id] = Gate(tuple(after))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._gates.pop(request_id, None)
        self._late.pop(request_id, None)  # a job still running reads only its matcher
        self._cached.pop(request_id, None)
        self._slow.discard(request_id)

    def accept(self, request_id: str, token_ids: list[int]) -> tuple[Verdict, str | None]:
        """Advance ``request_id``'s grammar over tokens appended to its output; the
        verdict, and the matcher's message when it broke."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return Verdict.GOING, None
        gate = self._gates.get(request_id)
        if gate is not None:
            opened = gate.opened_by(token_ids)
            if opened is None:
                gate.append(token_ids)
                return Verdict.GOING, None
            del self._gates[request_id]
            token_ids = token_ids[opened:]
            if not token_ids:
                return Verdict.GOING, None
        if not matcher.consume_tokens(token_ids):
            return Verdict.BROKEN, plain_error(matcher.get_error()) or "a token the grammar forbids"
        return (Verdict.COMPLETE if matcher.is_stopped() else Verdict.GOING), None

    def masks(self, inputs: StepInputs, defer: bool | None = None) -> StepMasks | None:
        """The masks of this step's constrained logits rows (None when no sampling row
        is constrained), computed in the mask thread: with ``overlap`` while the forward
        runs, else once the runner asks for them after it. ``defer`` False: the runner
        waits for every one (by default, unless the engine cannot defer a request)."""
        jobs = self._jobs(inputs)
        if not jobs:
            return None
        self.num_masked_rows += sum(len(job.rows) for job in jobs)
        defer = self._defer if defer is None else defer
        return StepMasks(jobs, self._thread, self._executor, self._hold_late, self._overlap, defer)

    def allowed_tokens(self, inputs: StepInputs) -> AllowedTokens | None:
        """The masks of this step's constrained rows, all of them, computed now."""
        masks = self.masks(inputs, defer=False)
        return None if masks is None else masks.ready(quiet=0.0, limit=0.0)

    def _jobs(self, inputs: StepInputs) -> list[MaskJob]:
        sampling = inputs.sampling
        jobs, first = [], 0
        words = -(-self.compiler.vocab_size // 32)
        drafts = sampling.draft_token_ids.tolist() if any(sampling.num_drafts) else None
        for index, (row, num_drafts) in enumerate(
            zip(sampling.rows, sampling.num_drafts, strict=True)
        ):
            request_id = inputs.request_ids[row]
            matcher = self._matchers.get(request_id)
            tokens = [] if drafts is None or matcher is None else drafts[index][:num_drafts]
            gate = self._gates.get(request_id)
            # Rows before the grammar starts are free: it starts after this many drafts.
            skip = 0 if gate is None or matcher is None else gate.opened_by(tokens)
            cached = self._cached.pop(request_id, None)
            if matcher is not None and skip is not None:
                rows = list(range(first + skip, first + 1 + num_drafts))
                job = MaskJob(request_id, index, matcher, rows, tokens[skip:], words, cached)
                jobs.append(job)
            first += 1 + num_drafts
        # A grammar that was slow before goes last, so the quick masks are not late
        # behind it.
        return sorted(jobs, key=lambda job: job.request_id in self._slow)

    def _hold_late(self, late: list[tuple[MaskJob, Future]]) -> None:
        """Requests whose masks were not ready: their step's tokens are dropped, and
        they wait out of the batch until ``settle`` finds their job done."""
        for job, future in late:
            self._late[job.request_id] = (job, future)
            self._slow.add(job.request_id)
        self.num_late_masks += len(late)

    def is_late(self, request_id: str) -> bool:
        """Whether the request's mask missed its step (its tokens are not to be kept)."""
        return request_id in self._late

    def waiting(self, request_id: str) -> bool:
        """Whether the request waits out of the batch for its mask."""
        late = self._late.get(request_id)
        return late is not None and not late[1].done()

    def takes_drafts(self, request_id: str) -> bool:
        """A request rejoining with the mask it waited for verifies no drafts that step
        (their masks would be new work of the same grammar)."""
        return request_id not in self._cached and request_id not in self._late

    def settle(self) -> list[tuple[str, str]]:
        """Before a step: the late masks that are done. Each request gets its mask to
        rejoin with, or, when the mask failed or took longer than ``MASK_SECONDS_LIMIT``,
        fails: returned as (request id, message)."""
        failed = []
        for request_id, (job, future) in list(self._late.items()):
            if not future.done():
                continue
            del self._late[request_id]
            if job.error is None and job.seconds > MASK_SECONDS_LIMIT:
                job.error = (
                    f"one of its masks took {job.seconds:.2f} s of CPU, over the limit of "
                    f"{MASK_SECONDS_LIMIT:g} s per mask"
                )
            if job.error is not None:
                failed.append((request_id, job.error))
            else:
                self._cached[request_id] = job.bitmask[:1]
        return failed

    def wait_late(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a late mask (when nothing else could run)."""
        pending = [future for _, future in self._late.values()]
        if pending:
            futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.compiler.close()
