"""Continuous batching: the plan of each step, and the one place where a step ends.

``schedule(drafts)`` plans a step. Running requests go first, in arrival order, then
waiting ones, within a per-step token budget and a cap on running requests. A prompt
longer than the remaining budget is prefilled in chunks. A decoding request carries the
drafts proposed for it, as many as the budget and its context length allow, and its KV
blocks are reserved for all of them. When the block pool runs dry the most recently
admitted request is preempted: its blocks are freed and it is recomputed later (cheaply,
when its blocks are still in the prefix cache). A request always comes back.

``update(plan, step_output)`` ends the step: it counts computed tokens (of a request's
drafts only the accepted ones), appends the new tokens, applies stop conditions, frees
the blocks of finished requests, records acceptance and returns the step's outputs.

A hybrid model's prefix cache also needs the recurrent state where a cached prefix
ends: a prompt's prefill is cut to end at its last full block, the step after copies
the state there into a prefix slot, and a request admitted on a hit has that state
copied into its own slot before its first step (``prefix_states.py``). The copies ride
in the plan (``StepPlan.state_copies``).

With speculative decoding every request that samples also keeps ``num_lookahead_tokens``
slots reserved past its step, so a proposer can write a draft model's KV for the next
round's drafts without allocating anything: the scheduler is the only caller of the
block manager.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from updraft.engine.grammars import Grammars, Verdict
from updraft.engine.kv_blocks import KVCacheManager
from updraft.engine.state_slots import StateSlots
from updraft.engine.stop import stop_condition
from updraft.outputs import RequestOutput, SpeculativeMetrics
from updraft.request import FinishReason, Request, RequestStatus
from updraft.step.output import StepOutput
from updraft.step.plan import Draft, ScheduledRequest, StateCopy, StepPlan
from updraft.structured_outputs import STRUCTURED_ERROR


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        grammars: Grammars | None = None,
        long_context_from: int | None = None,
        state_slots: StateSlots | None = None,
    ) -> None:
        """``grammars``: the state of constrained requests, advanced here as a step's
        tokens are appended and dropped when a request ends. ``state_slots``: a hybrid
        model's recurrent-state slots, one held by each running request. ``long_context_from``: a
        LongRoPE model's original context. A sequence longer than it is computed with
        the long frequencies at every position, so a request that grows past it has its
        KV recomputed, and no verify step reaches past it from below."""
        self.kv = kv_manager
        self.grammars = grammars
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.long_context_from = long_context_from
        self.state_slots = state_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.speculative = SpeculativeMetrics()
        self.constrained_speculative = SpeculativeMetrics()  # the rounds of constrained ones
        # A hybrid model's prefix states saved after the last step, run before the next.
        self._saves: list[StateCopy] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # -- planning a step -----------------------------------------------------------------

    def schedule(self, drafts: Mapping[str, Draft] | None = None) -> StepPlan:
        drafts = drafts or {}
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._waits_for_mask(request):
                index += 1
                continue
            num_known = request.num_tokens - request.num_computed_tokens
            draft = self._fit(drafts.get(request.request_id), request, budget - num_known)
            num_drafts = 0 if draft is None else len(draft.token_ids)
            room = self._to_boundary(
                request, request.num_computed_tokens, _prompt_chunk(request, budget)
            )
            item = ScheduledRequest(request, min(num_known + num_drafts, room), draft)
            while not self.kv.allocate(request, self._slots(item)):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            else:
                plan.scheduled.append(item)
                budget -= item.num_new_tokens
                index += 1
        restores = []
        # Admitting new work while evicting running work would only thrash.
        while not plan.preempted and self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            if self.state_slots is not None and not self.state_slots.num_free:
                break
            request = self.waiting[0]
            if self._waits_for_mask(request):  # preempted while its mask was late
                break
            cached = self.kv.cached_prefix(request)
            computed = len(cached) * self.kv.block_size
            remaining = request.num_tokens - computed
            num_new = self._to_boundary(
                request, computed, min(remaining, _prompt_chunk(request, budget))
            )
            if not self.kv.allocate(request, self._lookahead(computed, num_new, remaining), cached):
                break
            self.waiting.popleft()
            if self.state_slots is not None:
                self.state_slots.take(request)
            if cached and self.kv.prefix_states is not None:
                key = request.block_hashes[len(cached) - 1]
                restores.append(self.kv.prefix_states.restore(key, request.state_slot, computed))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        if plan.scheduled:  # else the saves wait for the next step that runs a forward
            plan.state_copies = [*self._saves, *restores]
            self._saves = []
        return plan

    def _waits_for_mask(self, request: Request) -> bool:
        return self.grammars is not None and self.grammars.waiting(request.request_id)

    def _to_boundary(self, request: Request, computed: int, count: int) -> int:
        """``count`` tokens from ``computed`` on, cut to end at the request's last full
        block boundary when they would cross it, where a hybrid model keeps prefix
        states: the state after that boundary is then saved (``_save_state``)."""
        if self.kv.prefix_states is None or request.sampling_params.prompt_logprobs is not None:
            return count
        boundary = self.kv.last_boundary(request)
        return boundary - computed if computed < boundary < computed + count else count

    def _save_state(self, request: Request, computed_before: int) -> None:
        """After a step that ended a request's tokens at its last full block boundary,
        plan the copy of its state there into a prefix slot, under that block's key.
        It runs at the start of the next step, before any forward writes the slot."""
        if self.kv.prefix_states is None or request.state_slot < 0:
            return
        boundary = self.kv.last_boundary(request)
        if not computed_before < boundary == request.num_computed_tokens:
            return
        key = self.kv.block_key(request, boundary // self.kv.block_size)
        copy = self.kv.prefix_states.save(key, request.state_slot, boundary)
        if copy is not None:
            self._saves.append(copy)

    def _fit(self, draft: Draft | None, request: Request, room: int) -> Draft | None:
        """The part of ``draft`` this step can verify: within the token budget and the
        context length, and only for a request that decodes."""
        if draft is None or request.num_tokens - request.num_computed_tokens != 1:
            return None
        if self.grammars is not None and not self.grammars.takes_drafts(request.request_id):
            return None
        limit = self.max_model_len
        if self.long_context_from is not None and request.num_tokens <= self.long_context_from:
            limit = self.long_context_from  # drafts past it would need long frequencies
        keep = max(0, min(room, limit - request.num_tokens))
        if keep == 0:
            return None
        if keep >= len(draft.token_ids):
            return draft
        probs = None if draft.probs is None else draft.probs[:keep]
        return Draft(draft.token_ids[:keep], probs)

    def _slots(self, item: ScheduledRequest) -> int:
        """KV slots ``item`` needs past the request's computed tokens."""
        request = item.request
        num_known = request.num_tokens - request.num_computed_tokens
        return self._lookahead(request.num_computed_tokens, item.num_new_tokens, num_known)

    def _lookahead(self, num_computed: int, num_new: int, num_known: int) -> int:
        """``num_new`` slots, plus the lookahead slots a proposer writes into when this
        step samples (reaches the last known token), never past the context length."""
        if num_new < num_known or not self.num_lookahead_tokens:
            return num_new
        return max(
            num_new, min(num_new + self.num_lookahead_tokens, self.max_model_len - num_computed)
        )

    def drafting(self) -> list[tuple[Request, int]]:
        """The requests that decode next step, each with the most drafts it may carry:
        those whose blocks already cover every position a proposer writes for them
        (a request whose step just sampled holds its lookahead slots; one whose prompt
        is a single token short of done, after a partial prefill chunk, does not)."""
        drafting = []
        for request in self.running if self.num_lookahead_tokens else ():
            if request.num_computed_tokens != request.num_tokens - 1:
                continue
            limit = min(self.num_lookahead_tokens, self.max_model_len - request.num_tokens)
            covered = len(request.block_ids) * self.kv.block_size
            if limit > 0 and request.num_tokens - 1 + limit <= covered:
                drafting.append((request, limit))
        return drafting

    # -- ending a step -------------------------------------------------------------------

    def update(self, plan: StepPlan, output: StepOutput) -> list[RequestOutput]:
        """Apply what the step produced; returns an output for every request that got
        new tokens or finished. Of a request's drafts only the accepted ones count as
        computed: the KV written for the rest is rolled back by not counting it."""
        now = time.perf_counter()
        rows = {request_id: row for row, request_id in enumerate(output.request_ids)}
        outputs = []
        for item in plan.scheduled:
            request = item.request
            row = rows.get(request.request_id)
            computed_before = request.num_computed_tokens
            late = row is not None and self._mask_was_late(request)
            # A request whose mask was late keeps none of this step's tokens, its drafts
            # included, however many the step accepted, and its last known token is
            # computed again when it rejoins.
            accepted = 0 if row is None or late else output.num_accepted[row]
            computed = item.num_new_tokens - item.num_drafts + accepted - int(late)
            request.num_computed_tokens += computed
            self.kv.register_computed(request)
            self._save_state(request, computed_before)
            self.kv.release_outside_window(request)
            if output.prompt_logprobs and request.request_id in output.prompt_logprobs:
                _record_prompt_logprobs(request, *output.prompt_logprobs[request.request_id])
            if row is None or late:
                continue  # a prefill chunk short of the prompt's end: nothing sampled
            if item.num_drafts:
                request.speculative.record(item.num_drafts, accepted)
                self.speculative.record(item.num_drafts, accepted)
                if self.grammars is not None and request.request_id in self.grammars:
                    self.constrained_speculative.record(item.num_drafts, accepted)
            logprobs = None if output.logprobs is None else output.logprobs[row]
            top = None if output.top_logprobs is None else output.top_logprobs[row]
            was_short = not self._is_long(request)
            token_ids = output.token_ids[row]
            blocked = request.request_id in output.no_token_allowed
            if blocked:  # its last row allowed nothing: that token is no sample
                token_ids = token_ids[:-1]
            new_tokens, new_logprobs = self._append(request, token_ids, logprobs, top, now)
            if blocked and not request.finished:
                request.error = no_token_allowed(request)
                self._end(request, FinishReason.ERROR)
            if was_short and self._is_long(request) and not request.finished:
                self._recompute(request)
            outputs.append(
                request.take_output(new_tokens, new_logprobs, bool(self.num_lookahead_tokens))
            )
        return outputs

    def _mask_was_late(self, request: Request) -> bool:
        return self.grammars is not None and self.grammars.is_late(request.request_id)

    def _append(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: list[float] | None,
        top: list[dict[int, float]] | None,
        now: float,
    ) -> tuple[list[int], list[float] | None]:
        """Append tokens in order until one ends the request; returns those appended."""
        if request.first_token_time is None:
            request.first_token_time = now
        keep_logprobs = logprobs is not None and request.sampling_params.returns_logprobs
        k = request.sampling_params.num_top_logprobs
        keep_top = keep_logprobs and top is not None and k > 0
        constrained = self.grammars is not None and request.request_id in self.grammars
        for count, token_id in enumerate(token_ids, start=1):
            request.token_ids.append(token_id)
            if keep_logprobs:
                request.logprobs.append(logprobs[count - 1])
            if keep_top:  # the step's rows carry its largest ask: this request's k first
                request.top_logprobs.append(dict(list(top[count - 1].items())[:k]))
            reason = stop_condition(request, token_id, self.max_model_len)
            # The grammar sees every token, an end of sequence too (one it does not
            # accept ends the request with an error before the next step: ``settle``).
            if constrained and self._completes_grammar(request, token_id) and reason is None:
                reason = FinishReason.STOP
            if reason is not None:
                self._end(request, reason)
                token_ids = token_ids[:count]
                break
        return token_ids, logprobs[: len(token_ids)] if keep_logprobs else None

    def _completes_grammar(self, request: Request, token_id: int) -> bool:
        """Advance a constrained request's grammar by one appended token, token by
        token, so a request ends where its grammar completes however many tokens its
        step emitted."""
        return self.grammars.accept(request.request_id, [token_id]) is Verdict.COMPLETE

    def finish(self, request: Request, reason: FinishReason) -> RequestOutput | None:
        """End a request (aborted, or refused before it ran) and free its blocks; returns
        its last output, or None when it had already finished."""
        if request.finished:
            return None
        self._end(request, reason)
        return request.take_output([], None, bool(self.num_lookahead_tokens))

    def _end(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        if self.state_slots is not None:
            self.state_slots.give_back(request)
        if self.grammars is not None:
            self.grammars.remove(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.perf_counter()
        self.requests.pop(request.request_id, None)

    def _is_long(self, request: Request) -> bool:
        return self.long_context_from is not None and request.num_tokens > self.long_context_from

    def _recompute(self, request: Request) -> None:
        """Drop a request's KV (and its blocks' prefix-cache keys, which depended on its
        length) so that its next steps compute every position again: it grew past a
        LongRoPE model's original context."""
        self.kv.free(request)
        request.block_hashes = []
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        if self.state_slots is not None:
            self.state_slots.give_back(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)


def no_token_allowed(request: Request) -> str:
    """The error of a request whose settings together left no token to sample."""
    params = request.sampling_params
    settings = [
        name
        for name, on in (
            ("structured_outputs", params.structured_outputs is not None),
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("bad_words", bool(params.bad_words)),
            ("min_tokens", params.min_tokens > 0),
            ("logit_bias", bool(params.logit_bias)),
        )
        if on
    ]
    message = (
        f"no token is allowed at output token {request.num_output_tokens + 1}: "
        f"{', '.join(settings) or 'the request'} leave none"
    )
    return STRUCTURED_ERROR + message if params.structured_outputs is not None else message


# A prompt whose logprobs are asked for is computed in chunks of at most this many
# tokens: each of its tokens then has a logits row over the whole vocabulary.
PROMPT_LOGPROBS_CHUNK = 512


def _prompt_chunk(request: Request, budget: int) -> int:
    """The tokens ``request`` may compute this step, within ``budget``."""
    if (
        request.sampling_params.prompt_logprobs is not None
        and request.num_computed_tokens < request.num_prompt_tokens
    ):
        return min(budget, PROMPT_LOGPROBS_CHUNK)
    return budget


def _record_prompt_logprobs(request: Request, first: int, entries: list[dict[int, float]]) -> None:
    """Append the prompt positions not recorded yet (a preempted request computes its
    prompt again)."""
    recorded = request.prompt_logprobs
    skip = len(recorded) - first
    if skip >= 0:
        recorded.extend(entries[skip:])
