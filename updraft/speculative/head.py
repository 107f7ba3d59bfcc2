"""Draft heads that read the target's own hidden states: DeepSeek's MTP layer and EAGLE.

A head is a small model beside the target (``DraftHead``): it reads token embeddings
beside the target's hidden states and drafts through the target's LM head. Its entry i
pairs the token at position i + 1 with the target's hidden state at i, and lives in the
head's own KV cache at the target's slot for position i: every slot it writes is one the
target has already been given, and entry i's context is entries 0..i. (Where entry i is
turned by RoPE is the head's own convention: MTP turns it at i + 1, EAGLE at i.)

After every target step one head step over the step's rows (the mirror) writes the
entries whose next token is known: a prompt chunk's rows (its last row pairs with the
prompt's next token, ``StepInputs.next_token_ids``), and of a sampling request the rows
up to its last accepted one, whose next tokens are the accepted drafts and the token
sampled after them. Rows past the accepted ones write nothing (slot -1). The mirror's
output at a request's last accepted row is entry n - 2 of its n tokens: the newest token
beside the target's newest hidden state, so the first draft comes from it. Draft step d
(1..k-1) is entry n - 2 + d: the previous draft beside the head's own output there,
chained. Its slots are the lookahead slots the scheduler reserved.

Steps whose rows are uniform (the mirrors of decode and verify steps, and draft steps)
replay captured graphs, whose declared inputs are the standard ones plus the target's
hidden states (``HEAD_GRAPH_INPUTS``): a replay refreshes them from the step it is given,
like everything else; padded rows write the spare slot and are never read. When every
drafting request is greedy, draft steps 1..k-1 are one replay of the captured draft loop
instead (``speculative/draft_loop.py``), which derives each step's inputs inside the graph.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import ClassVar, Protocol

import torch

from updraft.attention.cache_layout import CacheLayout, allocate_kv_cache
from updraft.attention.metadata import AttentionMetadata
from updraft.request import Request
from updraft.runner.captured import CapturedSteps
from updraft.runner.runner import Runner
from updraft.speculative.draft_loop import CapturedDraftLoop, DraftLoopInputs
from updraft.speculative.proposer import draft_token_by_token
from updraft.step.inputs import GRAPH_INPUTS, GraphInput, StepInputs, block_table_of
from updraft.step.output import StepOutput
from updraft.step.plan import Draft

HEAD_GRAPH_INPUTS = (
    *GRAPH_INPUTS,
    GraphInput("hidden_states", ("tokens", "hidden"), pad=0.0, dtype=None),
)


class DraftHead(Protocol):
    """A head as a model a captured step can run (an ``nn.Module``)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """Entries ``positions`` of the tokens ``input_ids`` (each one position on from
        its entry) beside ``hidden_states`` -> the head's hidden states, which the next
        draft step chains on."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class HeadProposer:
    wants_hidden_states: ClassVar[bool] = True
    runner: Runner | None = None  # the head runs beside the target's model

    def __init__(
        self,
        target: Runner,
        head: DraftHead,
        layout: CacheLayout,
        num_layers: int,
        hidden_size: int,
        num_speculative_tokens: int,
    ) -> None:
        self.target = target
        self.head = head
        self.caches = allocate_kv_cache(
            num_layers,
            target.num_blocks,
            target.positions_per_block,
            layout,
            target.dtype,
            target.device,
        )
        self.block_size = target.positions_per_block
        self.device = target.device
        # How each head step ran: "graph" or "eager", counted.
        self.step_modes: Counter[str] = Counter()
        self.captured = None
        self.draft_loop = None
        # Graphs as the target's (whose capture sizes they share), unless asked for eager.
        if target.captured is not None and not target.config.speculative_enforce_eager:
            # the model, its cache and the buckets: the same for both kinds of graph
            where = (
                head,
                self.caches,
                self.block_size,
                target.captured.max_blocks,
                target.captured.sizes,
                self.device,
            )
            self.captured = CapturedSteps(
                *where,
                query_lens=(1, 1 + num_speculative_tokens),
                inputs=HEAD_GRAPH_INPUTS,
                compile_runs=target.config.compiles_graphs,
                full=target.captured.full,
                sizes_of_dims={"hidden": hidden_size},
            )
            # Greedy drafting replays the whole draft loop as one graph.
            if num_speculative_tokens > 1:
                self.draft_loop = CapturedDraftLoop(
                    *where,
                    num_speculative_tokens,
                    hidden_size,
                    compile_runs=target.config.compiles_graphs,
                )

    def _forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head over ``step`` (entries, their next tokens and the hidden states it
        pairs them with) -> its hidden states, and by graph replay when the step fits a
        bucket, the logits of every row the graph computed with them (else None)."""
        bucket = None if self.captured is None else self.captured.bucket_for(step)
        if bucket is not None:
            self.step_modes["graph"] += 1  # "graph" / "eager", as a runner counts
            hidden, logits = self.captured.run(step, bucket)
            return hidden.clone(), logits.clone()
        self.step_modes["eager"] += 1
        metadata = AttentionMetadata.from_step(step, self.block_size, self.device)
        hidden = self.head(
            step.input_ids.to(self.device),
            step.positions.to(self.device),
            self.caches,
            metadata,
            step.hidden_states,
        )
        return hidden, None

    def _mirror(
        self, inputs: StepInputs, output: StepOutput, last_rows: dict[str, int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write the entries of this step's rows whose next token is known: up to each
        sampling request's last accepted row (``last_rows``), and all of a prompt
        chunk's rows. -> the head's output at every row (as ``_forward``)."""
        next_ids = inputs.input_ids.roll(-1).clone()
        slots = inputs.slot_mapping.clone()
        emitted = dict(zip(output.request_ids, output.token_ids, strict=True))
        for row, request_id in enumerate(inputs.request_ids):
            end = inputs.query_starts[row + 1]
            if request_id in last_rows:
                last = last_rows[request_id]
                next_ids[last] = emitted[request_id][-1]  # the token sampled after it
                slots[last + 1 : end] = -1  # rejected drafts: no entry
            else:
                next_ids[end - 1] = inputs.next_token_ids[row]
        return self._forward(
            replace(
                inputs, input_ids=next_ids, slot_mapping=slots, hidden_states=output.hidden_states
            )
        )

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        last_rows = last_accepted_rows(inputs, output)
        mirrored, mirrored_logits = self._mirror(inputs, output, last_rows)
        chosen = [(r, limit) for r, limit in drafting if limit and r.request_id in last_rows]
        if not chosen:
            return {}
        # Each request's chained state: first the mirror's at its newest entry.
        newest = torch.tensor([last_rows[r.request_id] for r, _ in chosen], device=self.device)
        states = mirrored.index_select(0, newest)
        if mirrored_logits is None:
            first_logits = self.head.compute_logits(states)
        else:
            first_logits = mirrored_logits.index_select(0, newest)
        limits = [limit for _, limit in chosen]
        if (
            self.draft_loop is not None
            and max(limits) > 1
            and self.draft_loop.fits(len(chosen))
            and all(request.sampling_params.greedy for request, _ in chosen)
        ):
            return self._loop_drafts(chosen, first_logits.argmax(dim=-1), states)
        state_rows = list(range(len(chosen)))

        def logits_of(step: StepInputs, rows: list[int]) -> torch.Tensor:
            nonlocal states, state_rows
            if len(rows) < len(state_rows):  # the batch shrank: drop finished requests
                states = states[[state_rows.index(i) for i in rows]]
            states, logits = self._forward(replace(step, hidden_states=states))
            state_rows = rows
            return self.head.compute_logits(states) if logits is None else logits

        return draft_token_by_token(
            chosen,
            lambda request: request.num_tokens - 2,
            logits_of,
            self.block_size,
            self.target.generator,
            first_logits=first_logits,
        )

    def _loop_drafts(
        self, chosen: list[tuple[Request, int]], first: torch.Tensor, states: torch.Tensor
    ) -> dict[str, Draft]:
        """Greedy drafts of ``chosen`` by one replay of the draft loop, from each
        request's first draft and the head's state at its newest entry."""
        requests = [request for request, _ in chosen]
        limits = [limit for _, limit in chosen]
        drafts = self.draft_loop.run(
            DraftLoopInputs(
                input_ids=first,
                positions=torch.tensor([r.num_tokens - 1 for r in requests]),
                block_table=block_table_of([r.block_ids for r in requests]),
                query_start_loc=torch.arange(len(requests) + 1),
                draft_limits=torch.tensor(limits),
                hidden_states=states,
            )
        )
        self.step_modes["graph"] += max(limits) - 1  # the head steps it ran
        return {
            request.request_id: Draft(tokens[:limit], None)
            for request, limit, tokens in zip(requests, limits, drafts.tolist(), strict=True)
        }


def last_accepted_rows(inputs: StepInputs, output: StepOutput) -> dict[str, int]:
    """Per request that sampled this step: the flat row of its last token that is now
    part of its sequence (its last known token, or its last accepted draft)."""
    accepted = dict(zip(output.request_ids, output.num_accepted, strict=True))
    rows = {}
    for row, num_drafts in zip(inputs.sampling_rows, inputs.num_drafts, strict=True):
        request_id = inputs.request_ids[row]
        end = inputs.query_starts[row + 1]
        rows[request_id] = end - 1 - num_drafts + accepted[request_id]
    return rows
