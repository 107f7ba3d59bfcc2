"""Every way of running a step on stale or wrong inputs that the mutation tests show is
caught, in one place. Each is applied with pytest's ``monkeypatch`` to the class that
would carry the bug, before the engine is made, and undone after the test; on the
ranks other than 0, ``on_other_ranks`` (a worker pool's initializer) installs the
``RANK_MUTATIONS`` in each worker, each on only while a switch file names it.

* ``forget_refresh``: the graphs of one runner stop refreshing one declared input, as a
  code path that forgot it would (the bug class updraft exists to rule out);
* ``first_draft_from_the_row_before``: a head drafts from the wrong row of the mirror;
* ``draft_mirror_on``: the draft model's mirror step runs on another view of the step
  than the one the target ran (the previous batch's, one rank's chunks, one rank's
  context lengths);
* ``head_fed``: a head replicated across the prefill-context ranks is fed its rank's
  own view of each split step (its chunks, or its chunks' context lengths) instead of
  the global step;
* ``hidden_states``: the target's hidden states of a split step reach the heads
  ungathered (each rank's own rows, zeros for the rest) or gathered in rank order
  instead of the step's;
* Gemma 4's assistant: ``assistant_reads_one_on`` (a draft at position p also reads
  the target's K/V at p, as transformers lets it after a rejection, where the target
  has not written the newest token's), ``assistant_state_from_the_row_before`` (its
  first draft reads the target's hidden state one row before the last accepted one);
* ``fail_in_a_head_step``: the rank exits, or hangs, when a head's forward reaches it;
* a hybrid model's recurrent state: ``padded_rows_write_slot`` (a bucket's padded
  requests write a live request's slot), ``conv_window_shifted`` (the causal conv keeps
  its window one token off), ``restarts_from_the_slot`` (a query from position 0 on,
  after preemption too, starts from the slot's last state, not from zeros),
  ``verify_keeps_only_its_last_state`` (a verify step leaves only the state after its
  last draft, accepted or not), ``skip_state_restores`` (a prefix-cache hit skips
  its state copy).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import updraft.runner.runner as runner_module
import updraft.speculative.assistant as assistant_module
import updraft.step.inputs as inputs_module
from updraft.graph.static_input import StaticInput
from updraft.models import delta_rule, gated_delta_net
from updraft.models.gated_delta_net import GatedDeltaNet
from updraft.parallel.topology import GroupRank
from updraft.runner.follower import Follower
from updraft.runner.rank_messages import HiddenRows, RankStep
from updraft.speculative.draft_model import DraftModel
from updraft.speculative.head import HeadProposer
from updraft.step.inputs import GRAPH_INPUTS, GraphInput, StepInputs
from updraft.step.prefill_split import PrefillSplit, split_step, splits

Active = Callable[[], bool]  # whether a mutation installed for a process's life is on


def always() -> bool:
    return True


def forget_refresh(
    monkeypatch: pytest.MonkeyPatch, name: str, graph: str = "target", active: Active = always
) -> None:
    """The graphs ``graph`` (``target``, ``draft``, ``head``, ``head draft loop``) never
    refresh their declared input ``name``: they replay whatever it last held."""
    refresh = StaticInput.refresh

    def forgetful(self: StaticInput, values) -> None:
        if (self.name, self.graph) != (name, graph) or not active():
            refresh(self, values)

    monkeypatch.setattr(StaticInput, "refresh", forgetful)


def first_draft_from_the_row_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head's first draft reads its state and logits one row before each request's
    newest entry, as a path that took the wrong row of the verify step would."""
    mirror = HeadProposer.mirror

    def shifted(self, inputs, output, last_rows, newest):
        forward = mirror(self, inputs, output, last_rows, [max(row - 1, 0) for row in newest])
        return forward._replace(hidden_states=forward.hidden_states.roll(1, 0))

    monkeypatch.setattr(HeadProposer, "mirror", shifted)


def assistant_reads_one_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 4's assistant attends over the target's positions up to its own."""
    monkeypatch.setattr(assistant_module, "context_lengths", lambda positions: positions + 1)


def assistant_state_from_the_row_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 4's assistant drafts from the target's state one row before each request's
    last accepted row."""
    rows_of = assistant_module.last_accepted_rows

    def row_before(inputs, output):
        return {request: max(row - 1, 0) for request, row in rows_of(inputs, output).items()}

    monkeypatch.setattr(assistant_module, "last_accepted_rows", row_before)


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


def head_fed(monkeypatch: pytest.MonkeyPatch, view: str, active: Active = always) -> None:
    """On a rank other than 0, its head runs each split step's ``view``: ``chunks``
    (the rank's own chunks at their local slots, its hidden states the target's rows of
    them; the head's output is put back at those rows) or ``seq_lens`` (the global step
    with the context lengths of the rank's chunks)."""
    run = Follower.run

    def run_local(self: Follower, message) -> None:
        target = self.runners["target"]
        group = target.place.prefill_context
        step = message.inputs.forward if isinstance(message, RankStep) else None
        whole = target.whole_query_len
        if message.runner != "head" or step is None or not splits(step, whole) or not active():
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

    monkeypatch.setattr(Follower, "run", run_local)


def own_rows(split: PrefillSplit, group: GroupRank) -> torch.Tensor:
    """The step's rows that ``group.rank`` computes, in its local order."""
    padded = split.kv_slot_mapping.numel() // group.size
    local = split.order - group.rank * padded
    mine = ((local >= 0) & (local < padded)).nonzero().flatten()
    return mine[local[mine].argsort()]


def hidden_states(monkeypatch: pytest.MonkeyPatch, bug: str, active: Active = always) -> None:
    """A split step's hidden states are ``ungathered`` (the rank's own rows; zeros
    where the other ranks' rows belong) or gathered ``in_rank_order`` (every rank's
    rows, padding included, as gathered)."""
    gather = runner_module.in_step_order

    def wrong(hidden: torch.Tensor, group: GroupRank, split: PrefillSplit) -> torch.Tensor:
        if not active():
            return gather(hidden, group, split)
        if bug == "in_rank_order":
            return gather(hidden, group, replace(split, order=torch.arange(split.order.numel())))
        gather(hidden, group, split)  # the other ranks still gather
        padded = hidden.shape[0]
        whole = hidden.new_zeros((group.size * padded, hidden.shape[1]))
        whole[group.rank * padded : (group.rank + 1) * padded] = hidden
        return whole.index_select(0, split.order.to(hidden.device))

    monkeypatch.setattr(runner_module, "in_step_order", wrong)


def fail_in_a_head_step(monkeypatch: pytest.MonkeyPatch, how: str, active: Active = always) -> None:
    """The rank ``exit``s, or ``hang``s (alive, never arriving again), when a head's
    forward reaches it."""
    run = Follower.run

    def failing(self: Follower, message) -> None:
        if message.runner == "head" and active():
            if how == "exit":
                os._exit(3)
            time.sleep(3600)
        run(self, message)

    monkeypatch.setattr(Follower, "run", failing)


# What a rank other than 0 can get wrong, by name: each takes (monkeypatch, active).
def skip_state_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid model's prefix-cache hit resumes without its state copy: the copies
    out of a prefix slot (``engine/prefix_states.py``) are dropped, so the request
    reads whatever its running slot held."""
    copy_states = runner_module.Runner.copy_states

    def skipping(self: runner_module.Runner, copies: tuple) -> None:
        copy_states(self, tuple(c for c in copies if c.src_slot < self.num_state_slots))

    monkeypatch.setattr(runner_module.Runner, "copy_states", skipping)


RANK_MUTATIONS: dict[str, Callable[[pytest.MonkeyPatch, Active], None]] = {
    **{
        f"stale {graph} {name}": partial(forget_refresh, name=name, graph=graph)
        for graph, name in [
            ("head", "block_table"),
            ("head", "slot_mapping"),
            ("head", "seq_lens"),
            ("head draft loop", "block_table"),
        ]
    },
    "head fed its chunks": partial(head_fed, view="chunks"),
    "head fed its chunks' seq_lens": partial(head_fed, view="seq_lens"),
    "hidden states ungathered": partial(hidden_states, bug="ungathered"),
    "hidden states in rank order": partial(hidden_states, bug="in_rank_order"),
    "exit in a head step": partial(fail_in_a_head_step, how="exit"),
    "hang in a head step": partial(fail_in_a_head_step, how="hang"),
}


def on_other_ranks(switch: str) -> None:
    """A worker pool's initializer (``partial(on_other_ranks, path)``): install every
    mutation of ``RANK_MUTATIONS`` in this worker for its life, each on only while the
    file ``switch`` holds its name (a worker outlives the test that sets it; rank 0,
    which does not install them, stays right)."""
    for name, install in RANK_MUTATIONS.items():
        install(pytest.MonkeyPatch(), active=partial(switch_names, Path(switch), name))


def switch_names(switch: Path, name: str) -> bool:
    try:
        return switch.read_text() == name
    except FileNotFoundError:
        return False


# -- a hybrid model's recurrent state -------------------------------------------------


def padded_rows_write_slot(monkeypatch: pytest.MonkeyPatch, slot: int) -> None:
    """Padded requests of a graph bucket get state slot ``slot`` (a live request's)
    instead of -1, the spare: their writes land in that request's state."""
    padded = GraphInput("state_slots", ("requests",), pad=slot)
    monkeypatch.setattr(inputs_module, "STATE_GRAPH_INPUTS", (*GRAPH_INPUTS, padded))


def conv_window_shifted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The causal conv keeps the window one token too early: the K - 1 channels before
    the newest token's, instead of the newest K - 1."""

    def shifted(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor):
        kernel = weight.shape[1]
        sequence = torch.cat([window, x.transpose(1, 2)], dim=2)
        out = F.conv1d(sequence, weight[:, None, :], groups=weight.shape[0])
        end = sequence.shape[2] - 1
        return F.silu(out).transpose(1, 2), sequence[:, :, end - (kernel - 1) : end]

    monkeypatch.setattr(delta_rule, "causal_conv", shifted)


def restarts_from_the_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A query from position 0 on (a new request, or a preempted one computed again)
    starts from whatever its slot holds rather than from a zero state."""
    initial = GatedDeltaNet.initial_states

    def stale(self, cache: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor):
        # The row before position 1 of the slot: what its last occupant left there.
        return initial(self, cache, slots, starts.clamp(min=1))

    monkeypatch.setattr(GatedDeltaNet, "initial_states", stale)


def verify_keeps_only_its_last_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify step runs the chunked form, as a prefill chunk does, and so keeps only
    the state after its last draft: where that draft was rejected, the next step starts
    from a state no accepted token left."""
    monkeypatch.setattr(gated_delta_net, "token_by_token", lambda query_len, depth: query_len == 1)
