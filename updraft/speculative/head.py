"""Drafting with a head that reads the target's own hidden states: DeepSeek's MTP layer
and EAGLE (``models/draft_head.py``).

A head's entry i pairs the token at position i + 1 with the target's hidden state at i,
and lives in the head's own KV cache at the target's slot for position i: every slot it
writes is one the target has already been given, and entry i's context is entries
0..i. The head runs in a runner of its own, like any model: its steps replay captured
graphs whose declared inputs are the standard ones plus the target's hidden states
(``HEAD_GRAPH_INPUTS``), so a replay refreshes them from the step it is given.

After every target step one head step over the step's rows (the mirror) writes the
entries whose next token is known: a prompt chunk's rows (its last row pairs with the
prompt's next token, ``StepInputs.next_token_ids``), and of a sampling request the rows
up to its last accepted one, whose next tokens are the accepted drafts and the token
sampled after them. Rows past the accepted ones write nothing (slot -1). The mirror's
output at a request's last accepted row is entry n - 2 of its n tokens: the newest token
beside the target's newest hidden state, so the first draft comes from it. Draft step d
(1..k-1) is entry n - 2 + d: the previous draft beside the head's own output there,
chained. Its slots are the lookahead slots the scheduler reserved. When every drafting
request is greedy, draft steps 1..k-1 are one replay of the runner's captured draft
loop instead (``runner/draft_loop.py``), which derives each step's inputs in the graph.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch

from updraft.model_config import ModelConfig
from updraft.models.draft_head import DraftHead
from updraft.request import Request
from updraft.runner.draft_loop import DraftLoopInputs
from updraft.runner.rank_messages import HiddenRows, Send
from updraft.runner.runner import Forward, Runner
from updraft.speculative.proposer import draft_token_by_token
from updraft.step.inputs import HEAD_GRAPH_INPUTS, StepInputs, block_table_of
from updraft.step.output import StepOutput
from updraft.step.plan import Draft


def head_runner(
    target: Runner,
    head: DraftHead,
    head_config: ModelConfig,
    num_speculative_tokens: int,
    send: Send | None = None,
) -> Runner:
    """The head's runner beside ``target``'s, on the same rank: graphs where the target
    has them (unless the head's steps are asked to run eagerly), the same block ids and
    context split, and every prefill run whole (a head is replicated across the
    prefill-context ranks, each over the global step). ``head_config``: what the head's
    cache holds (its layers and KV heads)."""
    config = target.config
    eager = config.enforce_eager or bool(config.speculative_enforce_eager)
    return Runner(
        head,
        head_config,
        replace(config, enforce_eager=eager),
        target.max_model_len,
        dtype=target.dtype,
        name="head",
        query_lens=(1, 1 + num_speculative_tokens),
        num_blocks=target.num_blocks,
        place=target.place,
        inputs=HEAD_GRAPH_INPUTS,
        draft_loop_depth=num_speculative_tokens,
        splits_prefills=False,
        send=send,
    )


class HeadProposer:
    wants_hidden_states: ClassVar[bool] = True

    def __init__(self, target: Runner, runner: Runner) -> None:
        """``runner``: the head's (``head_runner``)."""
        self.target = target
        self.runner = runner

    def mirror(
        self,
        inputs: StepInputs,
        output: StepOutput,
        last_rows: dict[str, int],
        newest: list[int],
    ) -> Forward:
        """Write the entries of this step's rows whose next token is known: up to each
        sampling request's last accepted row (``last_rows``), and all of a prompt
        chunk's rows. -> the head's states at every row, and its logits at ``newest``."""
        step = inputs.forward
        next_ids = step.input_ids.roll(-1).clone()
        slots = step.slot_mapping.clone()
        emitted = dict(zip(output.request_ids, output.token_ids, strict=True))
        for row, request_id in enumerate(inputs.request_ids):
            end = step.query_starts[row + 1]
            if request_id in last_rows:
                last = last_rows[request_id]
                next_ids[last] = emitted[request_id][-1]  # the token sampled after it
                slots[last + 1 : end] = -1  # rejected drafts: no entry
            else:
                next_ids[end - 1] = inputs.next_token_ids[row]
        forward = replace(
            step, input_ids=next_ids, slot_mapping=slots, hidden_states=output.hidden_states
        )
        sampling = replace(inputs.sampling, logits_indices=torch.tensor(newest, dtype=torch.long))
        return self.runner.forward(
            replace(inputs, forward=forward, sampling=sampling, return_hidden_states=True),
            HiddenRows(self.target.name),
        )

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        last_rows = last_accepted_rows(inputs, output)
        chosen = [(r, limit) for r, limit in drafting if limit and r.request_id in last_rows]
        newest = [last_rows[r.request_id] for r, _ in chosen]
        mirrored = self.mirror(inputs, output, last_rows, newest)
        if not chosen:
            return {}
        # Each request's chained state: first the mirror's at its newest entry, then the
        # head's own output of the draft step before (rows ``source`` of ``last``).
        last, source = mirrored.hidden_states, newest
        limits = [limit for _, limit in chosen]
        if (
            max(limits) > 1
            and self.runner.fits_draft_loop(len(chosen))
            and all(request.sampling_params.greedy for request, _ in chosen)
        ):
            first = mirrored.logits.argmax(dim=-1)
            return self._loop_drafts(chosen, first, self._states(last, source))
        state_rows = list(range(len(chosen)))

        def logits_of(step: StepInputs, rows: list[int]) -> torch.Tensor:
            nonlocal last, source, state_rows
            if len(rows) < len(state_rows):  # the batch shrank: drop finished requests
                source = [source[state_rows.index(i)] for i in rows]
            states, hidden_from = self._states(last, source)
            head_step = replace(
                step,
                forward=replace(step.forward, hidden_states=states),
                return_hidden_states=True,
            )
            forward = self.runner.forward(head_step, hidden_from)
            last, source, state_rows = forward.hidden_states, list(range(len(rows))), rows
            return forward.logits

        return draft_token_by_token(
            chosen,
            lambda request: request.num_tokens - 2,
            logits_of,
            self.runner.positions_per_block,
            self.target.generator,
            first_logits=mirrored.logits,
        )

    def _states(self, last: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, HiddenRows]:
        """Rows ``rows`` of the head's last output, and where the other ranks find them."""
        hidden_from = HiddenRows(self.runner.name, tuple(rows))
        return hidden_from.of(last), hidden_from

    def _loop_drafts(
        self,
        chosen: list[tuple[Request, int]],
        first: torch.Tensor,
        states: tuple[torch.Tensor, HiddenRows],
    ) -> dict[str, Draft]:
        """Greedy drafts of ``chosen`` by one replay of the draft loop, from each
        request's first draft and the head's state at its newest entry."""
        requests = [request for request, _ in chosen]
        limits = [limit for _, limit in chosen]
        drafts = self.runner.draft_loop(
            DraftLoopInputs(
                input_ids=first,
                positions=torch.tensor([r.num_tokens - 1 for r in requests]),
                block_table=block_table_of([r.block_ids for r in requests]),
                query_start_loc=torch.arange(len(requests) + 1),
                draft_limits=torch.tensor(limits),
                hidden_states=states[0],
            ),
            [request.request_id for request in requests],
            states[1],
        )
        return {
            request.request_id: Draft(tokens[:limit], None)
            for request, limit, tokens in zip(requests, limits, drafts.tolist(), strict=True)
        }


def last_accepted_rows(inputs: StepInputs, output: StepOutput) -> dict[str, int]:
    """Per request that sampled this step: the flat row of its last token that is now
    part of its sequence (its last known token, or its last accepted draft)."""
    accepted = dict(zip(output.request_ids, output.num_accepted, strict=True))
    rows = {}
    sampling = inputs.sampling
    for row, num_drafts in zip(sampling.rows, sampling.num_drafts, strict=True):
        request_id = inputs.request_ids[row]
        end = inputs.forward.query_starts[row + 1]
        rows[request_id] = end - 1 - num_drafts + accepted[request_id]
    return rows
