"""``StepOutput``: what one forward produced, the one result of ``Runner.execute``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepOutput:
    """Per request that sampled (reached its last known token), in step order: the
    accepted drafts followed by one more token (the correction, or the bonus when every
    draft was accepted; a request without drafts just gets its next token)."""

    request_ids: list[str]
    token_ids: list[list[int]]
    num_accepted: list[int]
    # log_softmax of the raw logits at each emitted token; None unless a request asked.
    logprobs: list[list[float]] | None
    # [num_tokens, hidden_size] after the final norm, for every token of the step in
    # order, when the step asked for them (a proposer that reads the target's states).
    hidden_states: torch.Tensor | None
    forward_seconds: float  # the model forward alone, for host-overhead accounting
    mode: str  # "graph" or "eager (why)"
    # Per emitted token, the likeliest tokens and their logprobs, where some request
    # asked for them (as many as the step's largest ask).
    top_logprobs: list[list[dict[int, float]]] | None = None
    # Per request that asked for its prompt's logprobs and had prompt tokens in this
    # step: the prompt position scored first, then per position {token: logprob} (the
    # prompt's token first, then the likeliest).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] | None = None
    # Requests whose row at their last emitted token allowed no token at all (a
    # grammar, allowed_token_ids, bad words and min_tokens that together forbid every
    # one): that token is no sample, and the request ends with an error.
    no_token_allowed: frozenset[str] = frozenset()
