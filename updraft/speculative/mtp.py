"""Speculation with DeepSeek's multi-token prediction layer (``speculative_method="mtp"``).

The MTP layer (``models/mtp.py``) reads the target's own hidden states. Its entry i pairs
the token at position i + 1 with the target's hidden state at i, turns RoPE at i + 1,
and lives in the layer's own latent cache at the target's slot for position i: every
slot it writes is one the target has already been given, and entry i's context is
entries 0..i.

After every target step:

* the mirror step writes the entries of the step's rows whose next token is known: a
  prompt chunk's rows (its last row pairs with the prompt's next token,
  ``StepInputs.next_token_ids``), and of a sampling request the rows up to its last
  accepted one, whose next tokens are the accepted drafts and the token sampled after
  them. Rows past the accepted ones write nothing (slot -1);
* draft step d (0..k-1) of a drafting request with n tokens is entry n - 2 + d: the
  token n - 1 + d (the newest token, then its own drafts) with the hidden state of the
  target's last accepted row, then the layer's own output chained. Its slots are the
  target's (entry n - 2) and the lookahead slots the scheduler reserved past it.

The first MTP layer serves every draft step. Steps whose rows are uniform (draft steps,
and the mirrors of decode and verify steps) replay captured graphs, whose declared
inputs are the standard ones plus the target's hidden states (``MTP_GRAPH_INPUTS``): a
replay refreshes them from the step it is given, like everything else.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from updraft.attention.cache_layout import cache_layout
from updraft.attention.metadata import AttentionMetadata
from updraft.attention.paged import allocate_kv_cache
from updraft.models.mtp import MTPLayer, load_mtp_layers
from updraft.request import Request
from updraft.runner.captured import CapturedSteps
from updraft.runner.runner import Runner
from updraft.speculative.proposer import draft_token_by_token
from updraft.step.inputs import GRAPH_INPUTS, GraphInput, StepInputs
from updraft.step.output import StepOutput
from updraft.step.plan import Draft

MTP_GRAPH_INPUTS = (
    *GRAPH_INPUTS,
    GraphInput("hidden_states", ("tokens", "hidden"), pad=0.0, dtype=None),
)


class MTPModel(nn.Module):
    """The layer as a model a captured step can run: the target's embedding, rotary
    tables and LM head (shared, not copied) around the MTP layer. ``positions`` are the
    rotary positions, one past each entry's index."""

    def __init__(self, target: nn.Module, layer: MTPLayer) -> None:
        super().__init__()
        self.embed_tokens = target.model.embed_tokens
        self.rotary = target.rotary
        self.lm_head = target.lm_head
        self.layer = layer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        (cache,) = kv_caches
        rotary = self.rotary.lookup(positions, hidden_states.dtype)
        embeds = self.embed_tokens(input_ids)
        return self.layer(embeds, hidden_states, rotary, cache, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class MTPProposer:
    wants_hidden_states: ClassVar[bool] = True
    runner: Runner | None = None  # the layer runs beside the target's model

    def __init__(self, target: Runner, model_dir: str, num_speculative_tokens: int) -> None:
        config = target.model_config
        self.target = target
        layer = load_mtp_layers(config, model_dir, target.dtype, target.device).depths()[0]
        self.model = MTPModel(target.model, layer)
        self.cache = allocate_kv_cache(
            1,
            target.num_blocks,
            target.block_size,
            cache_layout(config),
            target.dtype,
            target.device,
        )[0]
        self.block_size = target.block_size
        self.device = target.device
        # How each MTP step ran: "graph" or "eager", counted.
        self.step_modes: Counter[str] = Counter()
        self.captured = None
        if target.captured is not None:
            self.captured = CapturedSteps(
                self.model,
                [self.cache],
                self.block_size,
                target.captured.max_blocks,
                target.captured.sizes,
                self.device,
                query_lens=(1, 1 + num_speculative_tokens),
                inputs=MTP_GRAPH_INPUTS,
                compile_runs=target.config.compiles_graphs,
                full=target.captured.full,
                sizes_of_dims={"hidden": config.hidden_size},
            )

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The layer over ``step`` (its tokens one position on, rotary positions one
        past each entry, and the hidden states it pairs them with) -> its hidden states,
        by graph replay when the step fits a bucket."""
        bucket = None if self.captured is None else self.captured.bucket_for(step)
        if bucket is not None:
            self.step_modes["graph"] += 1  # "graph" / "eager", as a runner counts
            hidden, _ = self.captured.run(step, bucket)
            return hidden.clone()
        self.step_modes["eager"] += 1
        metadata = AttentionMetadata.from_step(step, self.block_size, self.device)
        return self.model(
            step.input_ids.to(self.device),
            step.positions.to(self.device),
            [self.cache],
            metadata,
            step.hidden_states,
        )

    def _mirror(self, inputs: StepInputs, output: StepOutput, last_rows: dict[str, int]) -> None:
        """Write the entries of this step's rows whose next token is known: up to each
        sampling request's last accepted row (``last_rows``), and all of a prompt
        chunk's rows."""
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
        self._forward(
            replace(
                inputs,
                input_ids=next_ids,
                positions=inputs.positions + 1,
                slot_mapping=slots,
                hidden_states=output.hidden_states,
            )
        )

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        last_rows = last_accepted_rows(inputs, output)
        self._mirror(inputs, output, last_rows)
        chosen = [(r, limit) for r, limit in drafting if limit and r.request_id in last_rows]
        if not chosen:
            return {}
        # Each request's chained state: first the target's at its last accepted row.
        states = output.hidden_states.index_select(
            0,
            torch.tensor(
                [last_rows[r.request_id] for r, _ in chosen], device=output.hidden_states.device
            ),
        )
        state_rows = list(range(len(chosen)))

        def logits_of(step: StepInputs, rows: list[int]) -> torch.Tensor:
            nonlocal states, state_rows
            if len(rows) < len(state_rows):  # the batch shrank: drop finished requests
                states = states[[state_rows.index(i) for i in rows]]
            # entry n - 2 + d is fed token n - 1 + d (the query's own), RoPE at n - 1 + d
            step = replace(step, positions=step.positions + 1, hidden_states=states)
            states, state_rows = self._forward(step), rows
            return self.model.compute_logits(states)

        return draft_token_by_token(
            chosen,
            lambda request: request.num_tokens - 2,
            logits_of,
            self.block_size,
            self.target.generator,
        )


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
