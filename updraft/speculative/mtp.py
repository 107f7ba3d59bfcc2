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
from updraft.runner.rejection_sampler import sample_draft
from updraft.runner.runner import Runner
from updraft.step.inputs import Query, StepInputs
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
        requests, limits, hidden_rows = [], [], []
        for request, limit in drafting:
            row = last_row.get(request.request_id)
            if row is not None and limit > 0:
                requests.append(request)
                limits.append(limit)
                hidden_rows.append(row)
        if not requests:
            return {}
        hidden = output.hidden_states.index_select(
            0, torch.tensor(hidden_rows, device=output.hidden_states.device)
        )
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        rows = list(range(len(requests)))
        for depth in range(max(limits)):
            # The batch shrinks as requests reach their limits; their states go with them.
            kept = [i for i in rows if depth < limits[i]]
            if len(kept) < len(rows):
                hidden = hidden[[rows.index(i) for i in kept]]
            rows = kept
            queries = [
                Query(
                    requests[i],
                    requests[i].num_tokens - 2 + depth,
                    [drafts[i][-1] if depth else requests[i].token_ids[-1]],
                )
                for i in rows
            ]
            step = StepInputs.from_queries(queries, self.block_size)
            # entry n - 2 + d is fed token n - 1 + d: the query's own token
            hidden = self._forward(step, step.input_ids, hidden)
            logits = self.target.model.compute_logits(hidden)
            tokens, q = sample_draft(logits, step.sampling, self.target.generator)
            for row, (i, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                drafts[i].append(token)
                if q is not None and not requests[i].sampling_params.greedy:
                    probs[i].append(q[row])
        return {
            request.request_id: Draft(tokens, torch.stack(rows) if rows else None)
            for request, tokens, rows in zip(requests, drafts, probs, strict=True)
        }
