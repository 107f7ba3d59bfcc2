"""``Step``: everything one forward needs, built on the host from the scheduler's choice.

Nothing else is an input to a forward. Requests with a single query token (decodes) come
first, so attention can serve them as one group. ``pad_step`` is the one place that says
how a Step grows to a larger shape; every padded row is inert (writes no KV, attends to
nothing real).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from updraft.engine.request import Request
from updraft.runner.sampler import SamplingBatch

# Pad values, one per input: slot -1 writes into the cache's spare slot.
PAD_TOKEN_ID = 0
PAD_POSITION = 0
PAD_SLOT = -1
PAD_BLOCK = 0
PAD_SEQ_LEN = 0


class Query(NamedTuple):
    request: Request
    start: int  # position of the first token
    tokens: list[int]
    num_drafts: int = 0  # the last tokens are drafts to verify: keep their logits too


@dataclass
class Step:
    request_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    query_start_loc: list[int]  # [num_reqs + 1]
    query_lens: list[int]  # [num_reqs]
    seq_lens: list[int]  # [num_reqs] context length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_request]
    slot_mapping: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # [num_reqs] last token of each request
    num_decodes: int  # the first num_decodes requests have query length 1
    sampling: SamplingBatch
    # Speculative tokens at the end of each request's query; logits_indices then lists
    # the last 1 + num_drafts tokens of each request.
    num_drafts: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def build(cls, scheduled: list[tuple[Request, int]], block_size: int) -> Step:
        """The step the scheduler chose: each request's next ``num_new`` tokens from its
        first uncomputed one, ending with its draft tokens when it has any to verify.
        ``scheduled`` must list requests with one new token first."""
        queries = []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            known = request.num_tokens
            tokens = request.token_ids[start : start + num_new]
            num_drafts = max(0, start + num_new - known)
            drafts = request.draft_token_ids[:num_drafts]
            queries.append(Query(request, start, tokens + drafts, num_drafts))
        return cls.from_queries(queries, block_size)

    @classmethod
    def from_queries(cls, queries: list[Query], block_size: int) -> Step:
        """One forward over ``queries``, in order."""
        input_ids, positions, slots, num_drafts, logits_indices = [], [], [], [], []
        query_start_loc, query_lens, seq_lens = [0], [], []
        for request, start, tokens, drafts in queries:
            end = start + len(tokens)
            input_ids.extend(tokens)
            num_drafts.append(drafts)
            positions.extend(range(start, end))
            blocks = request.block_ids
            slots.extend(
                blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
            )
            query_lens.append(len(tokens))
            seq_lens.append(end)
            query_start_loc.append(end - start + query_start_loc[-1])
            logits_indices.extend(
                range(query_start_loc[-1] - 1 - num_drafts[-1], query_start_loc[-1])
            )
        requests = [query.request for query in queries]
        width = max(len(request.block_ids) for request in requests)
        block_table = torch.full((len(requests), width), PAD_BLOCK, dtype=torch.long)
        for row, request in enumerate(requests):
            block_table[row, : len(request.block_ids)] = torch.tensor(request.block_ids)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        return cls(
            request_ids=[request.request_id for request in requests],
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            query_start_loc=query_start_loc,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long),
            num_decodes=num_decodes,
            sampling=SamplingBatch.from_requests(requests),
            num_drafts=num_drafts,
        )


def decodes_first(scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
    return sorted(scheduled, key=lambda item: item[1] != 1)


def pad_step(step: Step, num_tokens: int, num_reqs: int) -> Step:
    """Grow ``step`` to ``num_tokens`` tokens and ``num_reqs`` requests with inert rows:
    padded tokens write slot -1 at position 0, padded requests have no query tokens
    (query_start_loc repeats its last value), seq_len 0 and an all-zero block table."""
    extra_tokens = num_tokens - step.num_tokens
    extra_reqs = num_reqs - step.num_reqs
    if extra_tokens < 0 or extra_reqs < 0:
        raise ValueError(
            f"cannot pad a step of {step.num_tokens} tokens / {step.num_reqs} requests "
            f"down to {num_tokens} / {num_reqs}"
        )

    def grow(tensor: torch.Tensor, extra: int, value: int) -> torch.Tensor:
        pad = torch.full((extra, *tensor.shape[1:]), value, dtype=tensor.dtype)
        return torch.cat([tensor, pad])

    return replace(
        step,
        input_ids=grow(step.input_ids, extra_tokens, PAD_TOKEN_ID),
        positions=grow(step.positions, extra_tokens, PAD_POSITION),
        slot_mapping=grow(step.slot_mapping, extra_tokens, PAD_SLOT),
        query_start_loc=step.query_start_loc + [step.num_tokens] * extra_reqs,
        query_lens=step.query_lens + [0] * extra_reqs,
        seq_lens=step.seq_lens + [PAD_SEQ_LEN] * extra_reqs,
        block_table=grow(step.block_table, extra_reqs, PAD_BLOCK),
        num_drafts=step.num_drafts + [0] * extra_reqs,
    )
