"""The plan of one step, as the scheduler decided it: which requests run, how many tokens
each, and which draft tokens each verifies.

Drafts reach the scheduler as an argument of ``schedule`` and leave it in this plan;
the step's inputs are built from the plan and the step's end reads it again. Nothing
about drafts is stored on a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from updraft.request import Request


class Draft(NamedTuple):
    """A proposer's guess at a request's next tokens."""

    token_ids: list[int]
    # The distribution each draft was drawn from, [len(token_ids), vocab]; None for a
    # deterministic proposer (q is then one-hot at each draft).
    probs: torch.Tensor | None = None


@dataclass(slots=True)  # one per request per step: cheap to make
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens from the first uncomputed one, then the drafts
    draft: Draft | None = None

    @property
    def num_drafts(self) -> int:
        return 0 if self.draft is None else len(self.draft.token_ids)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token, so that its logits
        give a new token (a partial prefill chunk samples nothing)."""
        request = self.request
        return request.num_computed_tokens + self.num_new_tokens - self.num_drafts >= (
            request.num_tokens
        )


class StateCopy(NamedTuple):
    """A hybrid model's recurrent state moved between slots before a step's forward:
    one row of every linear-attention layer's state tensor copied to another, slots as
    indexes of the whole tensor (running slots, then prefix slots;
    ``engine/prefix_states.py``)."""

    src_slot: int
    src_row: int
    dst_slot: int
    dst_row: int


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Run in this order before the forward: states saved after the last step, then
    # states restored for this step's prefix-cache hits.
    state_copies: list[StateCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)
