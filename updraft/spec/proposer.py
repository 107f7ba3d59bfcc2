"""The proposer interface: k draft tokens per request, for the target to verify.

Every proposer sees each target step (``observe``), so a draft model can keep its own
KV cache in step with the target's, and then proposes for the requests that will decode
next (``propose``). A proposal is the draft tokens and, for a sampling proposer, the
distribution each was drawn from; a deterministic proposer (n-gram) returns None there.
"""

from __future__ import annotations

from typing import Protocol

import torch

from updraft.engine.request import Request
from updraft.runner.step import Step
from updraft.spec.ngram import NgramProposer

Proposal = tuple[list[int], torch.Tensor | None]  # draft tokens, q [len, vocab] or None


class Proposer(Protocol):
    def observe(self, step: Step) -> None:
        """Called with every target step, after the target's forward."""

    def propose(self, requests: list[Request], limits: list[int]) -> list[Proposal]:
        """At most ``limits[i]`` drafts for ``requests[i]``, which has computed every
        token but its last; its blocks already cover its known tokens plus the limit."""


class NgramLookup:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n-gram. No model, no KV cache.

    When no request of the batch finds a match, none drafts, and the next step is a plain
    decode step. Otherwise a short or missing match is padded by repeating its last
    token (or the sequence's): any deterministic draft is verified exactly, a repeat is
    sometimes right, and full proposals keep every verify step at query length 1 + k,
    which a graph captures."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.ngram = NgramProposer(num_speculative_tokens)

    def observe(self, step: Step) -> None:
        pass

    def propose(self, requests: list[Request], limits: list[int]) -> list[Proposal]:
        matches = [
            self.ngram.propose(request.token_ids)[:limit]
            for request, limit in zip(requests, limits, strict=True)
        ]
        if not any(matches):
            return [([], None) for _ in requests]
        proposals = []
        for request, limit, tokens in zip(requests, limits, matches, strict=True):
            filler = tokens[-1] if tokens else request.token_ids[-1]
            proposals.append((tokens + [filler] * (limit - len(tokens)), None))
        return proposals
