"""Sanitize mode: every replay is checked against an eager run on a copy of the state.

A replay that reads a stale buffer still returns numbers; only a second, independent
computation shows they are wrong. Before each replay the persistent state (the KV cache)
is copied; the replay runs on the real state, the eager forward on the copy, and the
outputs and the states written are compared. The copy is of the whole cache, so a
replay that writes to slots it should not touch is caught too. That costs a full cache
copy per step: sanitize with a small KV cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


def default_tolerance(dtype: torch.dtype) -> float:
    """Replay and eager run the same ops on different batch shapes, which round
    differently: about 1e-6 in float32, a few units of the last place in half."""
    return 1e-3 if dtype == torch.float32 else 5e-2


@dataclass
class SanitizeReport:
    tolerance: float
    steps: int = 0
    max_output_diff: float = 0.0
    max_state_diff: float = 0.0
    mismatches: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        verdict = "ok" if self.healthy else f"{len(self.mismatches)} MISMATCHED"
        return (
            f"{self.steps} replays checked against eager, {verdict}: largest output "
            f"difference {self.max_output_diff:.2e}, largest KV difference "
            f"{self.max_state_diff:.2e} (tolerance {self.tolerance:.0e})"
        )


def checked_replay(
    replay: Callable[[], torch.Tensor],
    eager: Callable[[list[torch.Tensor]], torch.Tensor],
    state: Sequence[torch.Tensor],
    report: SanitizeReport,
    label: str,
    live: Callable[[int, torch.Tensor], torch.Tensor] = lambda index, tensor: tensor,
) -> torch.Tensor:
    """Run ``replay()`` on ``state`` and ``eager(copy of state)``; record both
    differences in ``report`` and return the replay's output. ``live(i, tensor)``
    selects the part of state tensor i that must agree (a cache's spare slot takes
    padded writes that eager never makes)."""
    # One copy per tensor, so that entries that are one tensor (a KV-shared layer's
    # cache is its source layer's) stay one in the copy.
    cloned: dict[int, torch.Tensor] = {}
    copies = [cloned.setdefault(id(tensor), tensor.clone()) for tensor in state]
    replayed = replay()
    expected = eager(copies)
    output_diff = _max_diff(replayed, expected)
    state_diff = max(
        (
            _max_diff(live(i, a), live(i, b))
            for i, (a, b) in enumerate(zip(state, copies, strict=True))
        ),
        default=0.0,
    )
    report.steps += 1
    report.max_output_diff = max(report.max_output_diff, output_diff)
    report.max_state_diff = max(report.max_state_diff, state_diff)
    if not output_diff <= report.tolerance or not state_diff <= report.tolerance:
        report.mismatches.append(
            f"{label}: output differs by {output_diff:.2e}, KV cache by {state_diff:.2e}"
        )
    return replayed


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item()
