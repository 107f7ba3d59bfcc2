"""One engine step with speculation: the target verifies every request's drafts in one
forward, the rejection sampler decides, and the proposer drafts the next round.

Requests with and without drafts share the step: a request without drafts is verified
with zero drafts, which samples one token exactly as the plain sampler would.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from updraft.config import EngineConfig
from updraft.engine.kv_blocks import KVCacheManager
from updraft.engine.request import Request
from updraft.runner.runner import Runner
from updraft.runner.step import Step
from updraft.spec.draft_model import DraftModel
from updraft.spec.metrics import SpecMetrics
from updraft.spec.proposer import NgramLookup, Proposer
from updraft.spec.rejection import verify


@dataclass
class StepTokens:
    """What one step produced, per request in step order."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]] | None
    logits: list[list[torch.Tensor]] | None  # with keep_logits, one row per token


class Speculator:
    def __init__(
        self,
        config: EngineConfig,
        target: Runner,
        kv: KVCacheManager,
        max_model_len: int,
    ) -> None:
        self.k = config.num_speculative_tokens
        self.target = target
        self.kv = kv
        self.max_model_len = max_model_len
        self.keep_logits = config.keep_logits
        self.proposer: Proposer
        if config.speculative_method == "ngram":
            self.proposer = NgramLookup(self.k)
        else:
            self.proposer = DraftModel(
                config, target.model_config, target.num_blocks, max_model_len, target.generator
            )
        self.metrics = SpecMetrics()

    def run(self, step: Step, requests: list[Request]) -> StepTokens:
        """The target forward and verification of ``step``; the draft model sees it too."""
        start = time.perf_counter()
        logits = self.target.forward(step).float()
        drafts = [
            request.draft_token_ids[:n]
            for request, n in zip(requests, step.num_drafts, strict=True)
        ]
        result = verify(
            *self._verify_inputs(logits, step, requests, drafts),
            step.sampling,
            self.target.generator,
        )
        middle = time.perf_counter()
        self.proposer.observe(step)
        self.metrics.draft_seconds += time.perf_counter() - middle
        self.metrics.verify_seconds += middle - start
        for request, n, accepted in zip(
            requests, step.num_drafts, result.num_accepted, strict=True
        ):
            self.metrics.record(n, accepted)
            request.spec.record(n, accepted)
        rows = None
        if self.keep_logits:
            offsets = list(itertools.accumulate((1 + n for n in step.num_drafts), initial=0))
            rows = [
                list(logits[offsets[i] : offsets[i] + len(tokens)].cpu())
                for i, tokens in enumerate(result.token_ids)
            ]
        return StepTokens(result.token_ids, result.num_accepted, result.logprobs, rows)

    def _verify_inputs(
        self, logits: torch.Tensor, step: Step, requests: list[Request], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor | None]:
        """Per-request logits rows [B, K+1, V], drafts [B, K] and q [B, K, V] (or None),
        padded to the longest draft of the step."""
        widest = max(step.num_drafts)
        index, first = [], 0
        for n in step.num_drafts:
            # Padding positions repeat the request's last row; the sampler ignores them.
            index.extend(first + min(i, n) for i in range(widest + 1))
            first += n + 1
        target_logits = logits.index_select(0, torch.tensor(index, device=logits.device))
        target_logits = target_logits.view(len(drafts), widest + 1, -1)
        draft_ids = torch.zeros(len(drafts), widest, dtype=torch.long)
        for row, tokens in enumerate(drafts):
            draft_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        draft_probs = None
        if any(request.draft_probs is not None for request in requests):
            vocab = logits.shape[-1]
            draft_probs = torch.zeros(len(drafts), widest, vocab, device=logits.device)
            for row, (request, tokens) in enumerate(zip(requests, drafts, strict=True)):
                if request.draft_probs is not None:
                    draft_probs[row, : len(tokens)] = request.draft_probs[: len(tokens)]
                else:  # a deterministic draft: q is one-hot at it
                    draft_probs[row, torch.arange(len(tokens)), tokens] = 1.0
        return target_logits, draft_ids.to(logits.device), step.num_drafts, draft_probs

    def propose(self, running: list[Request]) -> None:
        """Draft the next round for every request that will decode next step."""
        start = time.perf_counter()
        requests, limits = [], []
        for request in running:
            if request.finished or request.num_computed_tokens != request.num_tokens - 1:
                continue
            # Every request drafts k tokens, even past its max_tokens (the surplus is
            # dropped), so verify steps have one query length and replay a graph.
            limit = min(self.k, self.max_model_len - request.num_tokens)
            # The next verify writes KV at num_tokens + limit - 1 positions; without the
            # blocks for them the request just decodes without drafts this round.
            if limit < 1 or not self.kv.allocate(request, 1 + limit):
                continue
            requests.append(request)
            limits.append(limit)
        for request, (tokens, probs) in zip(
            requests, self.proposer.propose(requests, limits), strict=True
        ):
            request.draft_token_ids = tokens
            request.draft_probs = probs
        self.metrics.draft_seconds += time.perf_counter() - start
