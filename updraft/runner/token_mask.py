"""Constrained decoding's one op on the logits: tokens a row's grammar forbids get -inf,
before any filtering or sampling, outside the captured graph."""

from __future__ import annotations

import torch

from updraft.step.allowed_tokens import AllowedTokens

# The value of each bit of an int32 word (bit 31's is the sign bit, -2**31).
_BIT_VALUES = torch.tensor([1 << bit for bit in range(31)] + [-(1 << 31)], dtype=torch.int32)


def mask_logits(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """``logits`` [rows, vocab] with every token ``allowed`` forbids in its rows set to
    -inf (a new tensor; the logits a step returns stay as the model made them)."""
    device = logits.device
    rows = allowed.rows.to(device)
    bits = allowed.bitmask.to(device)
    keep = (bits.unsqueeze(-1) & _BIT_VALUES.to(device)).ne(0).flatten(1)
    vocab = logits.shape[1]
    width = min(vocab, keep.shape[1])
    constrained = torch.full((len(rows), vocab), float("-inf"), device=device)
    constrained[:, :width] = logits.index_select(0, rows)[:, :width].where(
        keep[:, :width], float("-inf")
    )
    return logits.index_copy(0, rows, constrained)
