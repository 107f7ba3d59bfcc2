"""Continuous batching: which requests run this step, and how many tokens each.

Running requests go first, in arrival order, then waiting ones, within a per-step token
budget and a cap on running requests. A prompt longer than the remaining budget is
prefilled in chunks. When the block pool runs dry the most recently admitted request is
preempted: its blocks are freed and it is recomputed later (cheaply, when its blocks are
still in the prefix cache). A request always comes back; none is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from updraft.engine.kv_blocks import KVCacheManager
from updraft.engine.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_known = request.num_tokens - request.num_computed_tokens
            # Drafts to verify ride along when the budget has room; extra ones are dropped.
            del request.draft_token_ids[max(0, budget - num_known) :]
            num_new = min(num_known + len(request.draft_token_ids), budget)
            while not self.kv.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                index += 1
        # Admitting new work while evicting running work would only thrash.
        while not out.preempted and self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            cached = self.kv.cached_prefix(request)
            remaining = request.num_tokens - len(cached) * self.kv.block_size
            num_new = min(remaining, budget)
            if not self.kv.allocate(request, num_new, cached):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        return out

    def update(
        self, out: SchedulerOutput, num_accepted: dict[str, int] | None = None
    ) -> list[Request]:
        """Advance computed tokens after the forward; returns the requests whose sampled
        token is real (their whole known sequence is now computed). Of a request's
        drafts only the ``num_accepted[request_id]`` accepted ones count as computed:
        the KV written for the rest is rolled back by not counting it."""
        sampled = []
        for request, num_new in out.scheduled:
            num_drafts = len(request.draft_token_ids)
            accepted = (num_accepted or {}).get(request.request_id, 0)
            request.num_computed_tokens += num_new - num_drafts
            if request.num_computed_tokens == request.num_tokens:
                sampled.append(request)
            request.num_computed_tokens += accepted
            request.draft_token_ids = []
            request.draft_probs = None
            self.kv.register_computed(request)
        return sampled

    def release_unused_blocks(self, request: Request) -> None:
        """Free blocks past the request's known tokens, such as those taken for drafts
        that were rejected."""
        if not request.finished:
            self.kv.trim(request, request.num_tokens)

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.draft_token_ids = []
        request.draft_probs = None
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
