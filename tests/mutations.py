"""Every way of running a step on stale or wrong inputs that the mutation tests show is
caught, in one place. Each is applied with pytest's ``monkeypatch`` to the class that
would carry the bug, before the engine is made, and undone after the test.

* ``forget_refresh``: the graphs of one runner stop refreshing one declared input, as a
  code path that forgot it would (the bug class updraft exists to rule out), in this
  process or (``forget_refresh_here``, a worker pool's initializer) on other ranks;
* ``first_draft_from_the_row_before``: a head drafts from the wrong row of the mirror;
* ``draft_mirror_on``: the draft model's mirror step runs on another view of the step
  than the one the target ran (the previous batch's, one rank's chunks, one rank's
  context lengths).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from updraft.graph.static_input import StaticInput
from updraft.speculative.draft_model import DraftModel
from updraft.speculative.head import HeadProposer
from updraft.step.inputs import StepInputs
from updraft.step.prefill_split import split_step, splits


def forget_refresh(monkeypatch: pytest.MonkeyPatch, name: str, graph: str = "target") -> None:
    """The graphs ``graph`` (``target``, ``draft``, ``head``, ``head draft loop``) never
    refresh their declared input ``name``: they replay whatever it last held."""
    refresh = StaticInput.refresh

    def forgetful(self: StaticInput, values) -> None:
        if (self.name, self.graph) != (name, graph):
            refresh(self, values)

    monkeypatch.setattr(StaticInput, "refresh", forgetful)


def forget_refresh_here(name: str, graph: str) -> None:
    """``forget_refresh`` for the rest of this process: what a worker pool's
    ``initializer`` applies on the ranks other than 0 alone (``functools.partial``)."""
    forget_refresh(pytest.MonkeyPatch(), name, graph)


def first_draft_from_the_row_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head's first draft reads its state and logits one row before each request's
    newest entry, as a path that took the wrong row of the verify step would."""
    mirror = HeadProposer.mirror

    def shifted(self, inputs, output, last_rows, newest):
        forward = mirror(self, inputs, output, last_rows, [max(row - 1, 0) for row in newest])
        return forward._replace(hidden_states=forward.hidden_states.roll(1, 0))

    monkeypatch.setattr(HeadProposer, "mirror", shifted)


def draft_mirror_on(
    monkeypatch: pytest.MonkeyPatch, view: Callable[[StepInputs, dict], StepInputs]
) -> None:
    """The draft model's mirror step (and so its KV) follows ``view(step, memory)`` of
    each step the target ran instead of the step itself; ``memory`` is kept across
    steps."""
    propose = DraftModel.propose
    memory: dict = {}

    def propose_on(self, inputs, output, drafting):
        return propose(self, view(inputs, memory), output, drafting)

    monkeypatch.setattr(DraftModel, "propose", propose_on)


def previous_batch(inputs: StepInputs, memory: dict) -> StepInputs:
    """What was prepared for the previous step."""
    stale, memory["inputs"] = memory.get("inputs", inputs), inputs
    return stale


def rank0_chunks(inputs: StepInputs, memory: dict) -> StepInputs:
    """What rank 0 of two prefill-context ranks runs of a split step: its own chunks,
    at local slots and lengths."""
    if not splits(inputs.forward, 4):
        return inputs
    split = split_step(inputs.forward, 0, 2, 4)
    no_logits = replace(inputs.sampling, logits_indices=torch.empty(0, dtype=torch.long))
    return replace(inputs, forward=split.local, sampling=no_logits)


def local_seq_lens(inputs: StepInputs, memory: dict) -> StepInputs:
    """Context lengths as one decode-context rank of two counts them."""
    seq_lens = (inputs.forward.seq_lens + 1) // 2
    return replace(inputs, forward=replace(inputs.forward, seq_lens=seq_lens))
