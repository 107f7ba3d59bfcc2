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
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
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

    def update(self, out: SchedulerOutput) -> list[Request]:
        """Advance computed tokens after the forward; returns the requests whose sampled
        token is real (their whole known sequence is now computed)."""
        sampled = []
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            self.kv.register_computed(request)
            if request.num_computed_tokens == request.num_tokens:
                sampled.append(request)
        return sampled

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
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
