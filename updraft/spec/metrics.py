"""Speculative decoding metrics: acceptance per draft position, accepted length, time.

A healthy drafter's acceptance rate conditional on reaching a position stays roughly
flat with depth; a rate that decays with depth is the signature of stale per-step state
in the draft steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    proposed: list[int] = field(default_factory=list)  # per position: drafts offered there
    accepted: list[int] = field(default_factory=list)  # per position: drafts accepted there
    reached: list[int] = field(default_factory=list)  # per position: offered, all before taken
    rounds: int = 0  # verify rounds that carried at least one draft
    emitted: int = 0  # tokens those rounds produced (accepted drafts + one each)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        while len(self.proposed) < num_drafts:
            self.proposed.append(0)
            self.accepted.append(0)
            self.reached.append(0)
        for position in range(num_drafts):
            self.proposed[position] += 1
            self.accepted[position] += position < num_accepted
            self.reached[position] += position <= num_accepted
        self.rounds += 1
        self.emitted += num_accepted + 1

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.proposed)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.proposed else 0.0

    def acceptance_per_position(self) -> list[float]:
        """Position i: accepted drafts at i over drafts offered at i (whether or not
        the earlier ones were accepted)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed, strict=True)]

    def conditional_acceptance(self) -> list[float]:
        """Position i: the rate at which a draft there is accepted given that every draft
        before it was."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached, strict=True)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify round, counting the one every round emits."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def summary(self) -> str:
        per_position = " ".join(f"{rate:.2f}" for rate in self.acceptance_per_position())
        return (
            f"acceptance {self.acceptance_rate:.2f} ({self.num_accepted_tokens}/"
            f"{self.num_draft_tokens} drafts), per position [{per_position}], mean accepted "
            f"length {self.mean_accepted_length:.2f}, draft {self.draft_seconds:.2f} s, "
            f"verify {self.verify_seconds:.2f} s"
        )
