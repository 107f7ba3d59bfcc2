"""``StaticInput``: one persistent buffer a captured graph reads, refreshed every replay.

The buffer is allocated once at the largest size and its address never changes. Each
refresh writes this step's values into its first rows (and first columns, for a block
table narrower than the buffer) and the pad value everywhere else, so rows left from a
larger earlier batch can never be read as live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StaticInput:
    name: str
    buffer: torch.Tensor
    fill: Callable[[Any], torch.Tensor]  # this step's values, unpadded
    pad: int | float

    def values(self, step: Any) -> torch.Tensor:
        """This step's values, checked against the buffer before anything is written."""
        values = self.fill(step)
        if values.dim() != self.buffer.dim() or any(
            n > limit for n, limit in zip(values.shape, self.buffer.shape, strict=True)
        ):
            raise ValueError(
                f"static input {self.name!r}: values of shape {tuple(values.shape)} do not "
                f"fit its buffer {tuple(self.buffer.shape)}"
            )
        return values

    def refresh(self, values: torch.Tensor) -> None:
        rows = values.shape[0]
        live = self.buffer[:rows]
        if values.dim() == 2 and values.shape[1] < self.buffer.shape[1]:
            live[:, values.shape[1] :].fill_(self.pad)
            live = live[:, : values.shape[1]]
        live.copy_(values, non_blocking=True)
        self.buffer[rows:].fill_(self.pad)
