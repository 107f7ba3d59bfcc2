"""What a request gives back: its text and tokens as they arrive, why it finished, and
how it went (latency, preemptions, speculative acceptance).

An output is made for every request at every step that gives it new tokens, so it must
cost the same at token 4,000 as at token 4. ``delta_*`` fields hold what is new;
``text``, ``token_ids`` and ``logprobs`` (everything so far) are read from the
request's append-only lists only when someone asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class SpeculativeMetrics:
    """Acceptance of draft tokens per draft position. A healthy proposer's acceptance
    given that every earlier draft was accepted stays roughly flat with depth; a rate
    that decays with depth is the signature of stale per-step state in draft steps."""

    proposed: list[int] = field(default_factory=list)  # per position: drafts offered there
    accepted: list[int] = field(default_factory=list)  # per position: drafts accepted there
    reached: list[int] = field(default_factory=list)  # per position: offered, all before taken
    rounds: int = 0  # verify rounds that carried at least one draft
    emitted: int = 0  # tokens those rounds produced (accepted drafts + one each)

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

    def copy(self) -> SpeculativeMetrics:
        return SpeculativeMetrics(
            list(self.proposed), list(self.accepted), list(self.reached), self.rounds, self.emitted
        )

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
            f"length {self.mean_accepted_length:.2f}"
        )


class OutputSoFar(NamedTuple):
    """Where a request's append-only lists stood when an output was made: reading a
    prefix later gives the output as of then, whatever was appended since."""

    sequence: list[int]  # prompt then output tokens
    start: int  # the first output token's index in ``sequence``
    end: int
    text_pieces: list[str]
    num_text_pieces: int
    logprobs: list[float] | None
    num_logprobs: int
    top_logprobs: list[dict[int, float]] | None = None  # as long as logprobs


NOTHING_YET = OutputSoFar([], 0, 0, [], 0, None, 0)


@dataclass(eq=False, slots=True)
class CompletionOutput:
    index: int = 0
    delta_text: str = ""  # what is new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[float] | None = None
    # Per new token: the likeliest tokens and their logprobs (SamplingParams.logprobs=k).
    delta_top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    so_far: OutputSoFar = field(default=NOTHING_YET, repr=False)

    @property
    def text(self) -> str:
        return "".join(self.so_far.text_pieces[: self.so_far.num_text_pieces])

    @property
    def token_ids(self) -> list[int]:
        return self.so_far.sequence[self.so_far.start : self.so_far.end]

    @property
    def logprobs(self) -> list[float] | None:
        """Log-probability of each output token under the model's unmodified
        distribution; None unless the request asked for them."""
        if self.so_far.logprobs is None:
            return None
        return self.so_far.logprobs[: self.so_far.num_logprobs]

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        """Per output token, the k likeliest tokens (``SamplingParams.logprobs=k``) and
        their log-probabilities; None unless asked for."""
        if self.so_far.top_logprobs is None:
            return None
        return self.so_far.top_logprobs[: self.so_far.num_logprobs]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    speculative: SpeculativeMetrics | None = None  # with speculative decoding

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    # With SamplingParams.prompt_logprobs: per prompt position, {its token: logprob, then
    # the likeliest tokens}, None at position 0; complete from the first output with tokens.
    prompt_logprobs: list[dict[int, float] | None] | None = None


def merge_outputs(latest: list[RequestOutput]) -> RequestOutput:
    """One request's sequences (``n > 1``) as one output: each sequence's latest output
    in ``latest``, any order; the completions come in index order, the output tokens
    are counted over all of them, and the first error found is the request's."""
    latest = sorted(latest, key=lambda output: output.outputs[0].index)
    first = latest[0]
    if len(latest) == 1:
        return first
    times = [o.metrics.first_token_time for o in latest if o.metrics.first_token_time is not None]
    ends = [o.metrics.finish_time for o in latest if o.metrics.finish_time is not None]
    metrics = RequestMetrics(
        arrival_time=first.metrics.arrival_time,
        first_token_time=min(times, default=None),
        finish_time=max(ends) if len(ends) == len(latest) else None,
        num_prompt_tokens=first.metrics.num_prompt_tokens,
        num_output_tokens=sum(o.metrics.num_output_tokens for o in latest),
        num_preemptions=sum(o.metrics.num_preemptions for o in latest),
    )
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[o.outputs[0] for o in latest],
        finished=any(o.finished for o in latest),  # only the last sequence's says so
        metrics=metrics,
        error=next((o.error for o in latest if o.error is not None), None),
        prompt_logprobs=first.prompt_logprobs,
    )
