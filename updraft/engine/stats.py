"""A read-only view of the engine for the server, the CLI and the doctor, and the clock
that splits each step's time into its phases."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace

from updraft.engine.prefix_states import PrefixStateStats
from updraft.graph.sanitize import SanitizeReport
from updraft.outputs import SpeculativeMetrics


def describe_steps(step_modes: dict[str, int]) -> str:
    """How steps ran, from a runner's ``step_modes``: e.g. "1 eager (prefill), 63 graph"."""
    return ", ".join(f"{n} {mode}" for mode, n in sorted(step_modes.items()))


# Everything but "forward" is host time: the engine's own overhead per step.
PHASES = ("schedule", "build", "forward", "sample", "update", "propose")


class StepClock:
    """Adds up the seconds spent in each phase of ``Engine.step``."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._last = 0.0

    def start(self) -> StepClock:
        self._last = time.perf_counter()
        return self

    def lap(self, phase: str, forward_seconds: float = 0.0) -> None:
        """Charge the time since the last lap to ``phase``, except ``forward_seconds``
        of it, which the model forward took."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last - forward_seconds
        self.seconds["forward"] += forward_seconds
        self._last = now


@dataclass(frozen=True)
class StructuredStats:
    """Requests whose output a grammar constrains (structured outputs)."""

    num_constrained: int  # running or waiting with a compiled grammar
    num_compiling: int  # waiting for their grammar to compile
    masked_rows: int  # logits rows masked so far (one per sampled token or verified draft)
    speculative: SpeculativeMetrics  # the verify rounds of constrained requests
    late_masks: int = 0  # masks that missed their step: their request waited a step out
    # Masks that cost the grammar process QUICK_MASK_SECONDS of CPU and went on below the
    # steps' priority (no step waits for them).
    costly_masks: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: dict[str, int]  # how the target's steps ran: "graph", "eager (prefill)", ...
    threads: int  # CPU threads the last step ran with (fewer while other processes are busy)
    draft_steps: dict[str, int] | None  # the same for the proposer's own model, if any
    speculative: SpeculativeMetrics | None  # acceptance per draft position
    sanitize: SanitizeReport | None  # with sanitize=True, the target's replays
    draft_sanitize: SanitizeReport | None
    num_steps: int
    phase_seconds: dict[str, float]  # totals per phase of a step (PHASES)
    positions_per_block: int  # of a sequence, per KV block (block_size x decode ranks)
    # Over several ranks: the messages rank 0 sent the others, by kind
    # (runner/rank_messages.py: RankStep, RankLoop).
    rank_messages: dict[str, int] | None = None
    structured: StructuredStats | None = None  # None: the model has no tokenizer
    # A hybrid model's recurrent-state slots (engine/state_slots.py); 0 for others.
    state_slots_used: int = 0
    state_slots_total: int = 0
    # With prefix caching, its recurrent states at cached prefixes' last block.
    prefix_states: PrefixStateStats | None = None
    # A model whose windowed layers keep their own pool (engine/window_blocks.py): its
    # blocks in use and in all; 0 for others (their layers share kv_blocks_*).
    window_blocks_used: int = 0
    window_blocks_total: int = 0

    def describe_steps(self) -> str:
        return describe_steps(self.steps)

    def describe_draft_steps(self) -> str:
        return describe_steps(self.draft_steps or {})


def snapshot_report(report: SanitizeReport | None) -> SanitizeReport | None:
    return None if report is None else replace(report, mismatches=list(report.mismatches))
