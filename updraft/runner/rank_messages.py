"""What rank 0 of a split model tells the other ranks: one message per forward.

Every model that runs across ranks (the target; a draft head, split over the tensor
group and replicated across the prefill-context group) runs each forward on every
rank, in the same order, so that the collectives inside it pair up. Rank 0 decides
what runs: its runner announces each forward (``RankStep``) or draft-loop replay
(``RankLoop``) just before it runs it, and every other rank runs the same one on its
runner of that name (``follower.py``). A message carries the forward's inputs as they
are, drafts included, however they were sampled, and never a request's sampling
state: the other ranks sample nothing, so rank 0's generators never leave it.

A head's hidden states do not travel: every rank already holds them (the residual
stream is whole on every tensor rank, and a prefill split is gathered back into step
order on every prefill-context rank). A message says where they come from instead
(``HiddenRows``): rows of the hidden states that a runner's last forward returned on
that rank, the target's (a head's mirror step) or the head's own (its draft steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from updraft.runner.draft_loop import DraftLoopInputs
from updraft.step.inputs import StepInputs
from updraft.step.logits_adjustments import NO_ADJUSTMENTS
from updraft.step.sampling_batch import SamplingBatch


class HiddenRows(NamedTuple):
    """Rows of the hidden states the runner named ``runner`` returned last (all of them
    when ``rows`` is None)."""

    runner: str
    rows: tuple[int, ...] | None = None

    def of(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return hidden
        return hidden.index_select(0, torch.tensor(self.rows, device=hidden.device))


@dataclass(frozen=True)
class RankStep:
    """Run ``inputs``' forward on the runner named ``runner``."""

    runner: str
    inputs: StepInputs  # no sampling state, no hidden states
    hidden_from: HiddenRows | None = None


@dataclass(frozen=True)
class RankLoop:
    """Replay the greedy draft loop of the runner named ``runner``."""

    runner: str
    inputs: DraftLoopInputs  # no hidden states
    request_ids: list[str]
    hidden_from: HiddenRows


RankMessage = RankStep | RankLoop
Send = Callable[[RankMessage], None]


def step_message(name: str, inputs: StepInputs, hidden_from: HiddenRows | None) -> RankStep:
    """What another rank needs of a step: its forward's inputs and where its logits are
    read, not the requests' sampling state nor hidden states it holds itself."""
    sampling = replace(
        inputs.sampling,
        batch=SamplingBatch([], []),
        draft_probs=[],
        adjustments=NO_ADJUSTMENTS,
        prompt_rows=None,
    )
    forward = replace(inputs.forward, hidden_states=None)
    return RankStep(name, replace(inputs, forward=forward, sampling=sampling), hidden_from)


def loop_message(
    name: str, inputs: DraftLoopInputs, request_ids: list[str], hidden_from: HiddenRows
) -> RankLoop:
    empty = torch.empty(0)
    return RankLoop(name, replace(inputs, hidden_states=empty), request_ids, hidden_from)
