"""A draft model: a smaller checkpoint with the same tokenizer and its own KV cache.

Its cache is separate tensors addressed by the same block ids and slots as the target's,
so it needs no bookkeeping of its own. Two kinds of draft step keep it right:

* step 0 runs on the target's own ``Step`` (same tokens, positions, slots and block
  table) after every target forward, so the draft's KV mirrors the target's: prompts,
  prefill chunks and verified tokens alike;
* steps 1..k then decode one token per request from the newest known token, each a
  fresh ``Step`` whose positions, slots and seq_lens advance by one.

Each of those steps replays a captured graph through ``graph.replay(step)`` when it fits
a bucket, so it is filled from that very step and from no buffer of another.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from updraft.config import EngineConfig, ModelConfig
from updraft.engine.request import Request
from updraft.runner.runner import Runner
from updraft.runner.step import Query, Step
from updraft.spec.proposer import Proposal
from updraft.spec.rejection import sample_draft


class DraftModel:
    def __init__(
        self,
        config: EngineConfig,
        target: ModelConfig,
        num_blocks: int,
        max_model_len: int,
        generator: torch.Generator,
    ) -> None:
        assert config.speculative_model is not None
        model_config = ModelConfig.from_dir(config.speculative_model)
        if model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_model {config.speculative_model} has a vocabulary of "
                f"{model_config.vocab_size} tokens, the target {target.vocab_size}; a draft "
                "model must share the target's tokenizer"
            )
        k = config.num_speculative_tokens
        draft_config = replace(
            config,
            model=config.speculative_model,
            enforce_eager=(
                config.enforce_eager
                if config.speculative_enforce_eager is None
                else config.speculative_enforce_eager
            ),
        )
        self.runner = Runner(
            model_config, draft_config, max_model_len, query_lens=(1, 1 + k), num_blocks=num_blocks
        )
        self.block_size = config.block_size
        self.generator = generator

    @property
    def step_modes(self):
        return self.runner.step_modes

    def observe(self, step: Step) -> None:
        self.runner.forward(step)

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Each request decodes from its newest known token, one position per step, until
        # it has its limit; the batch shrinks as requests reach theirs.
        for depth in range(max(limits, default=0)):
            rows = [i for i, limit in enumerate(limits) if depth < limit]
            queries = [
                Query(
                    requests[i],
                    requests[i].num_tokens - 1 + depth,
                    [drafts[i][-1] if depth else requests[i].token_ids[-1]],
                )
                for i in rows
            ]
            step = Step.from_queries(queries, self.block_size)
            logits = self.runner.forward(step)
            tokens, q = sample_draft(logits.float(), step.sampling, self.generator)
            for row, (i, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                drafts[i].append(token)
                # Greedy requests need no q: verification compares with the argmax.
                if q is not None and not requests[i].sampling_params.greedy:
                    probs[i].append(q[row])
        return [
            (tokens, torch.stack(rows) if rows else None)
            for tokens, rows in zip(drafts, probs, strict=True)
        ]
