"""The sampling fields that change logits (allowed tokens, bad words, min_tokens,
logit_bias, repetition, frequency and presence penalties), applied to a step's logits
rows outside the captured graph, in a few batched ops whatever the batch."""

from __future__ import annotations

import torch

from updraft.step.logits_adjustments import LogitsAdjustments


def adjust_logits(
    logits: torch.Tensor, adjustments: LogitsAdjustments, in_place: bool = False
) -> torch.Tensor:
    """``logits`` [rows, vocab] float32 as the requests asked: a new tensor, or
    ``logits`` itself with ``in_place`` (when nothing reads the model's own after)."""
    if adjustments.empty:
        return logits
    out = logits if in_place else logits.clone()
    device = out.device
    for rows, ids in adjustments.allowed:
        rows = rows.to(device)
        kept = out.index_select(0, rows).index_select(1, ids.to(device))
        limited = torch.full((len(rows), out.shape[1]), float("-inf"), device=device)
        limited[:, ids.to(device)] = kept
        out.index_copy_(0, rows, limited)
    added = adjustments.added
    if len(added):
        out.index_put_(
            (added.rows.to(device), added.tokens.to(device)),
            added.values.to(device),
            accumulate=True,
        )
    repetition = adjustments.repetition
    if len(repetition):
        at = (repetition.rows.to(device), repetition.tokens.to(device))
        values, penalty = out[at], repetition.values.to(device)
        out[at] = torch.where(values > 0, values / penalty, values * penalty)
    subtracted = adjustments.subtracted
    if len(subtracted):
        out.index_put_(
            (subtracted.rows.to(device), subtracted.tokens.to(device)),
            -subtracted.values.to(device),
            accumulate=True,
        )
    return out
