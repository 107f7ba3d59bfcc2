"""The grammar state of every constrained request, and the masks of each step.

``Grammars`` is the engine's one owner of that state. Its matchers live in the grammar
process (``engine/grammar_process.py``), each under the handle its compile gave: a
request's enters when its spec has compiled, advances only through ``accept`` (the
scheduler's update, with the tokens a step appended: accepted drafts and one more) and
leaves when the request ends. A preempted request keeps its matcher, since its tokens
stay; nothing of it lives on the ``Request``.

Each step, ``masks`` sends the grammar process what to compute: which tokens every
constrained sampling row may take, at a request's last known token and after each of
its drafts in turn (each mask from the state the drafts before it lead to; past a draft
the grammar forbids nothing is computed, since verification stops there anyway). With
``overlap`` they are computed while the forward runs. A mask that is not ready in time
never holds the step: its request waits out of the batch until it is
(``engine/step_masks.py``), and one slower than ``MASK_SECONDS_LIMIT`` ends it.

Appended tokens go to the grammar process without a wait for its answer. A request
ends where its grammar completes: within a step's accepted drafts, by what that step's
mask job found (``stops_after``); at the step's last token, before the next step once
the grammar process has said so (``settle``), or else by that step's mask job, which
answers with the verdict, and the request keeps none of that step's tokens. Either way
the request's tokens are those of a grammar advanced token by token.

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
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from updraft.engine.grammar_compiler import MASK_SECONDS_LIMIT
from updraft.engine.grammar_messages import BROKEN, COMPLETE
from updraft.engine.grammar_process import GrammarProcess
from updraft.engine.step_masks import MaskJob, StepMasks
from updraft.request import FinishReason
from updraft.step.allowed_tokens import AllowedTokens
from updraft.step.inputs import StepInputs
from updraft.structured_outputs import StructuredOutputsParams


class Verdict(enum.Enum):
    GOING = "going"  # the output may go on
    COMPLETE = "complete"  # the grammar takes nothing more: the output is done


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
    def __init__(self, process: GrammarProcess, overlap: bool = True, defer: bool = True) -> None:
        self.process = process
        self._handles: dict[str, int] = {}  # request id -> its matcher's handle
        self._gates: dict[str, Gate] = {}  # requests whose grammar has not started yet
        self._appended: dict[int, list[int]] = {}  # tokens not yet sent, by handle
        # This step's drafts after which a request's grammar is complete (its mask job's
        # ``stops_after``), left to be matched by the tokens it appends.
        self._ends_after: dict[str, list[int]] = {}
        self._overlap = overlap
        # Without it (a hybrid model, whose recurrent state cannot take a token back) a
        # step waits for every mask.
        self._defer = defer
        self._late: dict[str, tuple[MaskJob, Future]] = {}  # masks that missed their step
        self._cached: dict[str, torch.Tensor] = {}  # late masks done: [1, words] each
        self._slow: set[str] = set()  # requests whose last mask was late
        self.num_masked_rows = 0  # mask rows computed, over the engine's life
        self.num_late_masks = 0  # masks that missed their step

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._handles

    def __len__(self) -> int:
        return len(self._handles)

    def compile(self, spec: StructuredOutputsParams) -> Future[int]:
        """A matcher for ``spec`` in the grammar process: the future gives the handle to
        ``start`` with, or raises ``ValueError`` with the compiler's message. Cancelling
        it drops the matcher."""
        try:
            key = spec.key
        except ValueError as error:  # a json spec that is not JSON
            future: Future[int] = Future()
            future.set_exception(error)
            return future
        return self.process.compile(key)

    def wait_compiled(self, pending: list[Future], timeout: float) -> None:
        """Wait up to ``timeout`` for one of ``pending`` compiles."""
        self.process.wait(pending, timeout)

    def start(self, request_id: str, handle: int, after: Sequence[int] = ()) -> None:
        """Constrain ``request_id`` by the matcher of ``handle``, from the token after
        the output's first ``after`` on (at once if ``after`` is empty)."""
        self._handles[request_id] = handle
        if after:
            self._gates[request_id] = Gate(tuple(after))

    def remove(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self._appended.pop(handle, None)
            self.process.remove(handle)
        self._gates.pop(request_id, None)
        self._ends_after.pop(request_id, None)
        self._late.pop(request_id, None)
        self._cached.pop(request_id, None)
        self._slow.discard(request_id)

    def accept(self, request_id: str, token_ids: list[int]) -> Verdict:
        """Advance ``request_id``'s grammar over tokens appended to its output: COMPLETE
        where they complete it within this step's accepted drafts, else GOING (what the
        step's last token leads to comes from the grammar process: ``settle``)."""
        handle = self._handles.get(request_id)
        if handle is None:
            return Verdict.GOING
        gate = self._gates.get(request_id)
        if gate is not None:
            opened = gate.opened_by(token_ids)
            if opened is None:
                gate.append(token_ids)
                return Verdict.GOING
            del self._gates[request_id]
            token_ids = token_ids[opened:]
            if not token_ids:
                return Verdict.GOING
        self._appended.setdefault(handle, []).extend(token_ids)
        ends_after = self._ends_after.get(request_id)
        if ends_after is None:
            return Verdict.GOING
        if ends_after[: len(token_ids)] != token_ids:
            del self._ends_after[request_id]  # the step's tokens left its drafts
            return Verdict.GOING
        del ends_after[: len(token_ids)]
        if ends_after:
            return Verdict.GOING
        del self._ends_after[request_id]
        return Verdict.COMPLETE

    def _send_appended(self) -> None:
        if self._appended:
            self.process.accept(list(self._appended.items()))
            self._appended = {}

    def masks(self, inputs: StepInputs, defer: bool | None = None) -> StepMasks | None:
        """The masks of this step's constrained logits rows (None when no sampling row
        is constrained), computed in the grammar process: with ``overlap`` while the
        forward runs, else once the runner asks for them after it. ``defer`` False: the
        runner waits for every one (by default, unless the engine cannot defer a
        request)."""
        self._ends_after.clear()
        self._send_appended()
        jobs = self._jobs(inputs)
        if not jobs:
            return None
        self.num_masked_rows += sum(len(job.rows) for job in jobs)
        defer = self._defer if defer is None else defer
        return StepMasks(jobs, self.process, self._on_ready, self._overlap, defer)

    def allowed_tokens(self, inputs: StepInputs) -> AllowedTokens | None:
        """The masks of this step's constrained rows, all of them, computed now."""
        masks = self.masks(inputs, defer=False)
        return None if masks is None else masks.ready(quiet=0.0, limit=0.0)

    def _jobs(self, inputs: StepInputs) -> list[MaskJob]:
        sampling = inputs.sampling
        jobs, first = [], 0
        words = self.process.words
        drafts = sampling.draft_token_ids.tolist() if any(sampling.num_drafts) else None
        for index, (row, num_drafts) in enumerate(
            zip(sampling.rows, sampling.num_drafts, strict=True)
        ):
            request_id = inputs.request_ids[row]
            handle = self._handles.get(request_id)
            tokens = [] if drafts is None or handle is None else drafts[index][:num_drafts]
            gate = self._gates.get(request_id)
            # Rows before the grammar starts are free: it starts after this many drafts.
            skip = 0 if gate is None or handle is None else gate.opened_by(tokens)
            cached = self._cached.pop(request_id, None)
            if handle is not None and skip is not None:
                rows = list(range(first + skip, first + 1 + num_drafts))
                slow = request_id in self._slow
                job = MaskJob(request_id, index, handle, rows, tokens[skip:], words, cached, slow)
                jobs.append(job)
            first += 1 + num_drafts
        # A grammar that was slow before goes last, so the quick masks are not late
        # behind it.
        return sorted(jobs, key=lambda job: job.slow)

    def _on_ready(self, done: list[MaskJob], late: list[tuple[MaskJob, Future]]) -> None:
        """The runner has taken the step's masks: the done jobs' completions within
        their drafts are noted for ``accept``; requests whose masks were not ready (or
        that answered with a verdict) have their step's tokens dropped, and they wait
        out of the batch until ``settle`` finds their job done."""
        for job in done:
            if job.cached is None:  # computed in time (a rejoining mask says nothing)
                self._slow.discard(job.request_id)
            if job.reply.stops_after is not None:
                self._ends_after[job.request_id] = job.drafts[: job.reply.stops_after]
        for job, future in late:
            self._late[job.request_id] = (job, future)
            if job.reply is None:
                self._slow.add(job.request_id)
                self.num_late_masks += 1

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

    def settle(self) -> list[tuple[str, FinishReason, str | None]]:
        """Before a step: what the grammar process has answered. A request whose
        grammar its last tokens completed ends with a stop, one they broke with an
        error; a late mask that is done lets its request rejoin, or, when it failed or
        took longer than ``MASK_SECONDS_LIMIT``, ends it. Returned as (request id,
        reason, message)."""
        self._send_appended()
        self.process.poll()
        ended: dict[str, tuple[FinishReason, str | None]] = {}
        for request_id, (job, future) in list(self._late.items()):
            if not future.done():
                continue
            del self._late[request_id]
            job.take(future.result())
            reply = job.reply
            if reply.verdict is not None:
                ended[request_id] = _ending(reply.verdict, reply.error)
            elif reply.error is not None:
                ended[request_id] = (FinishReason.ERROR, reply.error)
            elif reply.seconds > MASK_SECONDS_LIMIT:
                ended[request_id] = (
                    FinishReason.ERROR,
                    f"one of its masks took {reply.seconds:.2f} s of CPU, over the limit "
                    f"of {MASK_SECONDS_LIMIT:g} s per mask",
                )
            else:
                self._cached[request_id] = job.bitmask[:1]
        for request_id, handle in self._handles.items():
            verdict = self.process.verdicts.get(handle)
            if verdict is not None and request_id not in ended:
                ended[request_id] = _ending(*verdict)
        return [(request_id, *ending) for request_id, ending in ended.items()]

    def wait_late(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a late mask (when nothing else could run)."""
        pending = [future for _, future in self._late.values()]
        if pending:
            self.process.wait(pending, timeout)

    def close(self) -> None:
        self.process.close()


def _ending(verdict: str, message: str | None) -> tuple[FinishReason, str | None]:
    if verdict == COMPLETE:
        return FinishReason.STOP, None
    assert verdict == BROKEN, verdict
    return FinishReason.ERROR, message or "a token the grammar forbids"
