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

The first MTP layer serves every draft step. Steps run eagerly (the layer's own graphs
are not captured yet).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch

from updraft.attention.cache_layout import cache_layout
from updraft.attention.metadata import AttentionMetadata
from updraft.attention.paged import allocate_kv_cache
from updraft.models.mtp import load_mtp_layers
from updraft.request import Request
from updraft.runner.runner import Runner
from updraft.speculative.proposer import draft_token_by_token
from updraft.step.inputs import StepInputs
from updraft.step.output import StepOutput
from updraft.step.plan import Draft


class MTPProposer:
    wants_hidden_states: ClassVar[bool] = True
    runner: Runner | None = None  # the layer runs beside the target's model

    def __init__(self, target: Runner, model_dir: str) -> None:
        config = target.model_config
        self.target = target
        self.layer = load_mtp_layers(config, model_dir, target.dtype, target.device).depths()[0]
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

    def _forward(
        self, step: StepInputs, token_ids: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The layer over ``step``'s rows: entry i of each row, fed ``token_ids`` (the
        tokens one position on) and ``hidden`` -> the layer's hidden states."""
        model = self.target.model
        metadata = AttentionMetadata.from_step(step, self.block_size, self.device)
        rotary = model.rotary.lookup((step.positions + 1).to(self.device), hidden.dtype)
        embeds = model.model.embed_tokens(token_ids.to(self.device))
        return self.layer(embeds, hidden, rotary, self.cache, metadata)

    def _mirror(self, inputs: StepInputs, output: StepOutput) -> None:
        """Write the entries of this step's rows whose next token is known."""
        next_ids = inputs.input_ids.roll(-1).clone()
        slots = inputs.slot_mapping.clone()
        sampled = dict(zip(output.request_ids, output.token_ids, strict=True))
        accepted = dict(zip(output.request_ids, output.num_accepted, strict=True))
        drafts = dict(zip(inputs.sampling_rows, inputs.num_drafts, strict=True))
        for row, request_id in enumerate(inputs.request_ids):
            start, end = inputs.query_starts[row], inputs.query_starts[row + 1]
            if request_id in sampled:
                # the known rows, then those of the drafts the target accepted
                valid = end - start - drafts[row] + accepted[request_id]
                next_ids[start + valid - 1] = sampled[request_id][-1]
                slots[start + valid : end] = -1
            else:
                next_ids[end - 1] = inputs.next_token_ids[row]
        step = replace(inputs, slot_mapping=slots)
        self._forward(step, next_ids, output.hidden_states)

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        self._mirror(inputs, output)
        # Each drafting request's last accepted row: the target's hidden state there.
        last_row = {}
        sampled = dict(zip(inputs.sampling_rows, inputs.num_drafts, strict=True))
        accepted = dict(zip(output.request_ids, output.num_accepted, strict=True))
        for row, request_id in enumerate(inputs.request_ids):
            if row in sampled and request_id in accepted:
                end = inputs.query_starts[row + 1]
                last_row[request_id] = end - 1 - sampled[row] + accepted[request_id]
        chosen = [(r, limit) for r, limit in drafting if limit and r.request_id in last_row]
        if not chosen:
            return {}
        rows_now = [last_row[request.request_id] for request, _ in chosen]
        chain = {
            "rows": list(range(len(chosen))),
            "hidden": output.hidden_states.index_select(
                0, torch.tensor(rows_now, device=output.hidden_states.device)
            ),
        }

        def logits_of(step: StepInputs, rows: list[int]) -> torch.Tensor:
            # Each request chains its own state; the batch shrinks as requests finish.
            hidden = chain["hidden"]
            if len(rows) < len(chain["rows"]):
                hidden = hidden[[chain["rows"].index(i) for i in rows]]
            # entry n - 2 + d is fed token n - 1 + d: the query's own token
            hidden = self._forward(step, step.input_ids, hidden)
            chain.update(rows=rows, hidden=hidden)
            return self.target.model.compute_logits(hidden)

        return draft_token_by_token(
            chosen,
            lambda request: request.num_tokens - 2,
            logits_of,
            self.block_size,
            self.target.generator,
        )
