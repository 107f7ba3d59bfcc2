"""A hybrid model's recurrent-state slots: one per running request.

A linear-attention layer keeps no KV per token but, per request, a conv window and a
recurrent state (``attention/cache_groups.py``). A request takes a slot when it is
admitted and gives it back when it finishes, is aborted or is preempted (a preempted
request is recomputed from its first token, so it needs no state kept). Slots carry no
prefix: a new request's first step starts from a zero state, derived inside the step
from its first position, so a slot needs no clearing when it changes hands.
"""

from __future__ import annotations

from updraft.request import Request


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # the lowest handed out first

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def take(self, request: Request) -> None:
        if request.state_slot >= 0:
            raise RuntimeError(
                f"request {request.request_id} already holds state slot {request.state_slot}"
            )
        if not self.free_slots:
            raise RuntimeError("no recurrent-state slot is free")
        request.state_slot = self.free_slots.pop()

    def give_back(self, request: Request) -> None:
        if request.state_slot >= 0:
            self.free_slots.append(request.state_slot)
            request.state_slot = -1
