"""``StaticInput``: one persistent buffer a captured graph reads, refreshed every replay.

The buffer is allocated once at the largest size and its address never changes. Each
refresh writes this step's values into its leading rows (and columns, for a block table
narrower than the buffer) and the pad value everywhere else, so rows left from a larger
earlier batch can never be read as live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

LAST = "last"  # pad by repeating the last value


def padded(values: torch.Tensor, shape: tuple[int, ...], pad: int | float | str) -> torch.Tensor:
    """``values`` in the leading corner of a tensor of ``shape``; the rest is ``pad``
    (or, for ``LAST``, the last value)."""
    if tuple(values.shape) == tuple(shape):
        return values
    fill = values[-1].item() if pad == LAST else pad
    out = values.new_full(shape, fill)
    out[tuple(slice(0, n) for n in values.shape)] = values
    return out


@dataclass(frozen=True)
class StaticInput:
    name: str
    buffer: torch.Tensor
    fill: Callable[[Any], torch.Tensor]  # this step's values, unpadded
    pad: int | float | str
    graph: str = ""  # whose graphs read it ("target", "head draft loop"), for messages

    def values(self, step: Any) -> torch.Tensor:
        """This step's values, checked against the buffer before anything is written."""
        values = self.fill(step)
        if values.dim() != self.buffer.dim() or any(
            n > limit for n, limit in zip(values.shape, self.buffer.shape, strict=True)
        ):
            raise ValueError(
                f"static input {self.name!r} ({self.graph or 'a graph'}'s): values of shape "
                f"{tuple(values.shape)} do not "
                f"fit its buffer {tuple(self.buffer.shape)}"
            )
        return values

    def refresh(self, values: torch.Tensor) -> None:
        self.buffer.copy_(padded(values, tuple(self.buffer.shape), self.pad), non_blocking=True)
