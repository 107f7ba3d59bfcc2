"""The proposer interface: at most k draft tokens per request, for the next step to verify.

After every step the engine calls ``propose`` with that step's inputs, what it produced
(``StepOutput``: tokens, accepted counts, and the target's hidden states when the
proposer sets ``wants_hidden_states``) and the requests that decode next, each with the
most drafts it may carry. The drafts go back to the scheduler as the argument of its
next ``schedule``; a proposer keeps nothing on a request and allocates nothing: KV slots
for a draft model's own draft steps are already reserved by the scheduler.

A new proposer is a class with this shape and one ``register_proposer`` call; nothing in
the engine or the scheduler changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from updraft.request import Request
from updraft.runner.rejection_sampler import sample_draft
from updraft.step.inputs import Query, StepInputs
from updraft.step.output import StepOutput
from updraft.step.plan import Draft

if TYPE_CHECKING:
    from updraft.runner.runner import Runner


class Proposer(Protocol):
    # Ask the target's runner for the hidden states of every token of each step.
    wants_hidden_states: bool
    # The runner of the proposer's own model, if it has one (its step modes and
    # sanitize report show up in the engine's stats).
    runner: Runner | None

    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        """Drafts by request id for ``drafting``'s requests, at most ``limit`` each; a
        request left out decodes without drafts. Each request in ``drafting`` has
        computed every token but its last, and its KV blocks cover ``limit`` positions
        from that last token on."""
        ...


def draft_token_by_token(
    drafting: list[tuple[Request, int]],
    first_position: Callable[[Request], int],
    logits_of: Callable[[StepInputs, list[int]], torch.Tensor],
    positions_per_block: int,
    generator: torch.Generator,
    first_logits: torch.Tensor | None = None,
) -> dict[str, Draft]:
    """The draft loop of a proposer with a model: step d decodes one token per request,
    the newest known token at d = 0 and its own previous draft after, at position
    ``first_position(request) + d``, until each request has its limit (the batch shrinks
    as requests reach theirs). ``logits_of(step, rows)`` runs the model over the step,
    whose queries are ``drafting``'s rows ``rows``, and returns their logits; a proposer
    that already has step 0's logits (one per request of ``drafting``) passes them as
    ``first_logits`` instead."""
    requests = [request for request, _ in drafting]
    limits = [limit for _, limit in drafting]
    drafts: list[list[int]] = [[] for _ in requests]
    probs: list[list[torch.Tensor]] = [[] for _ in requests]
    for depth in range(max(limits, default=0)):
        rows = [i for i, limit in enumerate(limits) if depth < limit]
        queries = [
            Query(
                requests[i],
                first_position(requests[i]) + depth,
                [drafts[i][-1] if depth else requests[i].token_ids[-1]],
            )
            for i in rows
        ]
        step = StepInputs.from_queries(queries, positions_per_block)
        logits = first_logits if depth == 0 and first_logits is not None else logits_of(step, rows)
        tokens, q = sample_draft(logits, step.sampling.batch, generator)
        for row, (i, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            drafts[i].append(token)
            # Greedy requests need no q: verification compares with the argmax.
            if q is not None and not requests[i].sampling_params.greedy:
                probs[i].append(q[row])
    return {
        request.request_id: Draft(tokens, torch.stack(rows) if rows else None)
        for request, tokens, rows in zip(requests, drafts, probs, strict=True)
    }
