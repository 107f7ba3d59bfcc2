"""Attention metadata: the per-step tensors every attention layer shares.

Derived from a ``Step`` alone, once per forward. Requests are split into groups of equal
shape class (all decodes; the rest) so that one padded attention call serves each group
without padding every decode up to the longest prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from updraft.runner.step import Step


@dataclass
class AttentionGroup:
    """A run of consecutive requests attended with one padded call.

    ``query_index`` [B, Qmax] picks each request's query tokens out of the flat batch;
    ``kv_slots`` [B, Kmax] names the KV-cache slot of each context position (through the
    block table); ``mask`` [B, 1, Qmax, Kmax] is causal and length-limited;
    ``output_index`` picks the group's real tokens, in order, out of the padded output.
    """

    query_index: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    output_index: torch.Tensor

    @classmethod
    def build(
        cls,
        query_start: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        block_size: int,
    ) -> AttentionGroup:
        max_query = max(query_lens)
        max_context = max(seq_lens)
        query_start_t = torch.tensor(query_start)
        query_lens_t = torch.tensor(query_lens)
        seq_lens_t = torch.tensor(seq_lens)
        rows = torch.arange(max_query)
        columns = torch.arange(max_context)

        # Padded query rows repeat the request's last real token: any valid index will do,
        # their output is never read.
        query_index = query_start_t[:, None] + torch.minimum(rows[None], query_lens_t[:, None] - 1)
        kv_slots = block_table[:, columns // block_size] * block_size + columns % block_size
        context_before = (seq_lens_t - query_lens_t)[:, None, None]
        mask = (rows[None, :, None] < query_lens_t[:, None, None]) & (
            columns[None, None, :] <= context_before + rows[None, :, None]
        )
        padded_index = torch.arange(len(query_lens))[:, None] * max_query + rows[None]
        output_index = padded_index[rows[None] < query_lens_t[:, None]]
        return cls(query_index, kv_slots, mask[:, None], output_index)

    def to(self, device: torch.device | str) -> AttentionGroup:
        return AttentionGroup(
            self.query_index.to(device),
            self.kv_slots.to(device),
            self.mask.to(device),
            self.output_index.to(device),
        )


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]; -1 writes into the spare slot
    groups: list[AttentionGroup]
    num_padding_tokens: int = 0  # trailing tokens of no request (see runner.step.pad_step)

    @classmethod
    def from_step(
        cls, step: Step, block_size: int, device: torch.device | str
    ) -> AttentionMetadata:
        """Decode requests (one query token) come first in a Step, then the rest, then any
        padding requests (no query tokens), which attend to nothing."""
        groups = []
        num_decodes = step.num_decodes
        num_real = sum(1 for n in step.query_lens if n > 0)
        bounds = [(0, num_decodes), (num_decodes, num_real)]
        for first, last in bounds:
            if first == last:
                continue
            groups.append(
                AttentionGroup.build(
                    step.query_start_loc[first:last],
                    step.query_lens[first:last],
                    step.seq_lens[first:last],
                    step.block_table[first:last],
                    block_size,
                ).to(device)
            )
        padding = step.num_tokens - step.query_start_loc[-1]
        return cls(step.slot_mapping.to(device), groups, padding)
