"""Which tokens the constrained logits rows of a step may take: a message from the
engine's grammars to the runner's sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AllowedTokens:
    """Bit ``t % 32`` of ``bitmask[i, t // 32]`` is set when token ``t`` is allowed at
    logits row ``rows[i]`` (rows as the runner reads them: per sampling request, its last
    known token, then its drafts). Rows not named are unconstrained; tokens past the
    bitmask's width (logits of no token of the tokenizer) are never allowed in a named
    row."""

    rows: torch.Tensor  # [R] int64
    bitmask: torch.Tensor  # [R, ceil(tokens / 32)] int32
    # Sampling requests (by index) whose masks were not ready: their rows are left
    # unconstrained, their tokens are not kept, and they draw no randomness of their own.
    late: tuple[int, ...] = ()


class PendingMasks(Protocol):
    """A step's masks as they are being computed (engine/step_masks.py)."""

    def ready(self, quiet: float, limit: float) -> AllowedTokens | None:
        """The masks done before ``quiet`` seconds pass without one finishing, and
        within ``limit`` in all; the rows of the rest are left unconstrained, and their
        requests' tokens not kept."""
