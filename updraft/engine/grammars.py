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
``overlap`` the masks are computed in a thread while the forward runs.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from updraft.engine.grammar_compiler import GrammarCompiler
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
    def __init__(self, compiler: GrammarCompiler, overlap: bool = True) -> None:
        self.compiler = compiler
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._gates: dict[str, Gate] = {}  # requests whose grammar has not started yet
        self._executor = llguidance.LLExecutor(1)
        self._thread = (
            ThreadPoolExecutor(1, thread_name_prefix="updraft-masks") if overlap else None
        )
        self.num_masked_rows = 0  # mask rows computed, over the engine's life

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
            return Verdict.BROKEN, matcher.get_error() or "a token the grammar forbids"
        return (Verdict.COMPLETE if matcher.is_stopped() else Verdict.GOING), None

    def masks(self, inputs: StepInputs) -> Future[AllowedTokens | None]:
        """The allowed tokens of this step's constrained logits rows (None when no
        sampling row is constrained), computed in the mask thread when there is one."""
        if self._thread is not None:
            return self._thread.submit(self.allowed_tokens, inputs)
        done: Future[AllowedTokens | None] = Future()
        done.set_result(self.allowed_tokens(inputs))
        return done

    def allowed_tokens(self, inputs: StepInputs) -> AllowedTokens | None:
        sampling = inputs.sampling
        jobs, rows, first = [], [], 0
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
            if matcher is not None and skip is not None:
                jobs.append((matcher, len(rows), tokens[skip:]))
                rows.extend(range(first + skip, first + 1 + num_drafts))
            first += 1 + num_drafts
        if not jobs:
            return None
        words = -(-self.compiler.vocab_size // 32)
        # All ones: a row past a draft the grammar forbids is left as it is.
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        pointer, row_bytes = bitmask.data_ptr(), words * 4
        plain = [(matcher, row) for matcher, row, tokens in jobs if not tokens]
        drafted = [job for job in jobs if job[2]]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, pointer, row_bytes, len(rows))
        if drafted:  # llguidance's call for drafts takes only rows that have some
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, pointer, row_bytes, len(rows)
            )
        self.num_masked_rows += len(rows)
        return AllowedTokens(torch.tensor(rows, dtype=torch.long), bitmask)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
        self.compiler.close()
