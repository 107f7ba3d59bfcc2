"""A step cut for prefill context parallelism: what each rank of a P-rank group runs.

Every rank derives its own part from the same broadcast ``ForwardInputs``, so they agree
without another message. A request whose query is longer than ``whole_query_len``
(a prefill chunk, not a decode or a verify step) is cut into 2P chunks of
ceil(len / 2P) tokens (the last ones shorter or empty: the query padded to a multiple
of 2P, the padding dropped); rank r takes chunks r and 2P - 1 - r, so every rank gets
a like share of the causal work. Each chunk runs as a chunked-prefill continuation at
its own positions, through its request's block table. Shorter queries stay whole on
rank 0.

Each rank's tokens are padded to the group's largest count (slot -1), so that the
per-layer K/V all-gather and the final hidden-state gather exchange equal parts; the
gathered hidden states are put back in the step's order by ``order``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace
from itertools import pairwise

import torch

from updraft.step.inputs import ForwardInputs, long_tensor


@dataclass(frozen=True)
class PrefillSplit:
    local: ForwardInputs  # this rank's chunks (and, on rank 0, the whole queries)
    request_rows: list[int]  # the step's request row of each of local's queries
    kv_slot_mapping: torch.Tensor  # [size * padded]: every rank's slots, in gather order
    order: torch.Tensor  # [step tokens]: each token's row among the gathered ones


def splits(inputs: ForwardInputs, whole_query_len: int) -> bool:
    """Whether any request of the step is cut (else every rank runs the whole step)."""
    return any(n > whole_query_len for n in inputs.query_lens)


def split_step(inputs: ForwardInputs, rank: int, size: int, whole_query_len: int) -> PrefillSplit:
    """Rank ``rank``'s part of ``inputs`` among ``size`` prefill-context ranks."""
    starts = inputs.query_starts
    taken = [array("q") for _ in range(size)]  # the step's token indices each rank runs
    rows = [array("q") for _ in range(size)]  # each sub-query's request row
    ends = [array("q") for _ in range(size)]  # each sub-query's context length
    lens = [array("q") for _ in range(size)]
    seq_lens = inputs.seq_lens.tolist()
    for row, (start, end) in enumerate(pairwise(starts)):
        length = end - start
        if length <= whole_query_len:
            pieces = [(0, start, end)]
        else:
            chunk = -(-length // (2 * size))
            pieces = []
            for owner in range(size):
                for index in (owner, 2 * size - 1 - owner):
                    first = start + index * chunk
                    last = min(first + chunk, end)
                    if first < last:
                        pieces.append((owner, first, last))
        for owner, first, last in pieces:
            taken[owner].extend(range(first, last))
            rows[owner].append(row)
            ends[owner].append(seq_lens[row] - (end - last))
            lens[owner].append(last - first)
    padded = max(len(t) for t in taken)
    order = torch.empty(inputs.num_tokens, dtype=torch.long)
    slots = []
    for owner, indices in enumerate(taken):
        index = long_tensor(indices)
        order[index] = torch.arange(len(indices)) + owner * padded
        slots.append(pad(inputs.slot_mapping[index], padded, -1))
    mine = long_tensor(taken[rank])
    query_start_loc = torch.zeros(len(lens[rank]) + 1, dtype=torch.long)
    torch.cumsum(long_tensor(lens[rank]), 0, out=query_start_loc[1:])
    rotary_rows = inputs.rotary_rows
    if rotary_rows is not None:  # a LongRoPE model's: taken with the tokens
        rotary_rows = pad(rotary_rows[mine], padded, 0)
    local = replace(
        inputs,
        input_ids=pad(inputs.input_ids[mine], padded, 0),
        positions=pad(inputs.positions[mine], padded, 0),
        slot_mapping=slots[rank],
        block_table=inputs.block_table[long_tensor(rows[rank])],
        seq_lens=long_tensor(ends[rank]),
        query_start_loc=query_start_loc,
        rotary_rows=None
        if inputs.rotary_rows is None
        else pad(inputs.rotary_rows[mine], padded, 0),
    )
    return PrefillSplit(local, list(rows[rank]), torch.cat(slots), order)


def pad(values: torch.Tensor, length: int, value: int) -> torch.Tensor:
    out = torch.full((length,), value, dtype=values.dtype)
    out[: values.numel()] = values
    return out
