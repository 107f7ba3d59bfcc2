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

from typing import TYPE_CHECKING, Protocol

from updraft.request import Request
from updraft.step.inputs import StepInputs
from updraft.step.output import StepOutput
from updraft.step.plan import Draft

if TYPE_CHECKING:
    from updraft.runner.runner import Runner


class Proposer(Protocol):
    # Ask the target's runner for the hidden states of every token of each step.
    wants_hidden_states: bool
    # The proposer's own model runner, if it has one (its step modes and sanitize
    # report show up in the engine's stats).
    runner: Runner | None

    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        """Drafts by request id for ``drafting``'s requests, at most ``limit`` each; a
        request left out decodes without drafts. Each request in ``drafting`` has
        computed every token but its last, and its KV blocks cover ``limit`` positions
        from that last token on."""
        ...
