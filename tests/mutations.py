"""Every way of running a step on stale or wrong inputs that the mutation tests show is
caught, in one place. Each is applied with pytest's ``monkeypatch`` to the class that
would carry the bug, before the engine is made, and undone after the test.

* ``forget_refresh``: the graphs of one runner stop refreshing one declared input, as a
  code path that forgot it would (the bug class updraft exists to rule out), in this
  process or (``forget_refresh_here``, a worker pool's initializer) on other ranks;
* ``first_draft_from_the_row_before``: a head drafts from the wrong row of the mirror;
* ``draft_mirror_on``: the draft model's mirror step runs on another view of the step
  than the one the target ran (the previous batch's, one rank's chunks, one rank's
  context lengths);
* ``head_fed_here`` (a worker pool's initializer): a head replicated across the
  prefill-context ranks is fed, on the ranks other than 0, its rank's own view of each
  split step (its chunks, or its chunks' context lengths) instead of the global step;
* ``hidden_states_here`` (a worker pool's initializer): the target's hidden states of a
  split step reach the other ranks' heads ungathered (each rank's own rows, zeros for
  the rest) or gathered in rank order instead of the step's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

import updraft.runner.runner as runner_module
from updraft.graph.static_input import StaticInput
from updraft.parallel.topology import GroupRank
from updraft.runner.rank_messages import Follower, HiddenRows, RankStep
from updraft.speculative.draft_model import DraftModel
from updraft.speculative.head import HeadProposer
from updraft.step.inputs import StepInputs
from updraft.step.prefill_split import PrefillSplit, split_step, splits


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


def head_fed_here(view: str) -> None:
    """For the rest of this process (a rank other than 0), its head runs each split
    step's ``view``: ``chunks`` (the rank's own chunks at their local slots, its hidden
    states the target's rows of them; the head's output is put back at those rows) or
    ``seq_lens`` (the global step with the context lengths of the rank's chunks)."""
    run = Follower.run

    def run_local(self: Follower, message) -> None:
        target = self.runners["target"]
        group = target.place.prefill_context
        step = message.inputs.forward if isinstance(message, RankStep) else None
        if message.runner != "head" or step is None or not splits(step, target.whole_query_len):
            return run(self, message)
        split = split_step(step, group.rank, group.size, target.whole_query_len)
        if view == "seq_lens":
            seq_lens = step.seq_lens.clone()
            seq_lens[split.request_rows] = split.local.seq_lens[: len(split.request_rows)]
            forward = replace(step, seq_lens=seq_lens)
            return run(self, replace(message, inputs=replace(message.inputs, forward=forward)))
        rows = own_rows(split, group)
        inputs = replace(
            message.inputs,
            forward=split.local,
            sampling=replace(
                message.inputs.sampling, logits_indices=torch.zeros(0, dtype=torch.long)
            ),
        )
        padded = split.local.num_tokens
        hidden_from = HiddenRows("target", tuple(rows.tolist()) + (0,) * (padded - len(rows)))
        run(self, replace(message, inputs=inputs, hidden_from=hidden_from))
        local = self.hidden["head"]
        self.hidden["head"] = local.new_zeros((step.num_tokens, local.shape[1])).index_copy(
            0, rows, local[: len(rows)]
        )

    pytest.MonkeyPatch().setattr(Follower, "run", run_local)


def own_rows(split: PrefillSplit, group: GroupRank) -> torch.Tensor:
    """The step's rows that ``group.rank`` computes, in its local order."""
    padded = split.kv_slot_mapping.numel() // group.size
    local = split.order - group.rank * padded
    mine = ((local >= 0) & (local < padded)).nonzero().flatten()
    return mine[local[mine].argsort()]


def hidden_states_here(bug: str) -> None:
    """For the rest of this process (a rank other than 0), a split step's hidden states
    are ``ungathered`` (the rank's own rows; zeros where the other ranks' rows belong)
    or gathered ``in_rank_order`` (every rank's rows, padding included, as gathered)."""
    gather = runner_module.in_step_order

    def wrong(hidden: torch.Tensor, group: GroupRank, split: PrefillSplit) -> torch.Tensor:
        if bug == "in_rank_order":
            return gather(hidden, group, replace(split, order=torch.arange(split.order.numel())))
        gather(hidden, group, split)  # the other ranks still gather
        padded = hidden.shape[0]
        whole = hidden.new_zeros((group.size * padded, hidden.shape[1]))
        whole[group.rank * padded : (group.rank + 1) * padded] = hidden
        return whole.index_select(0, split.order.to(hidden.device))

    pytest.MonkeyPatch().setattr(runner_module, "in_step_order", wrong)
