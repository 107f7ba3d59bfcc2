"""Prompt lookup: propose the tokens that followed the last time the text's ending
appeared earlier in the sequence. No model, no KV cache; the drafts are deterministic
(one-hot q for the rejection sampler)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from updraft.request import Request
from updraft.step.inputs import StepInputs
from updraft.step.output import StepOutput
from updraft.step.plan import Draft


@dataclass(frozen=True)
class NgramProposer:
    """Matches the longest suffix n-gram first, n from ``max_ngram`` down to ``min_ngram``,
    and among equally long matches the most recent one.

    When no request of the batch finds a match, none drafts, and the next step is a plain
    decode step. Otherwise a short or missing match is padded by repeating its last
    token (or the sequence's): any deterministic draft is verified exactly, a repeat is
    sometimes right, and full proposals keep every verify step at query length 1 + k,
    which a graph captures."""

    num_speculative_tokens: int
    max_ngram: int = 3
    min_ngram: int = 1
    wants_hidden_states: ClassVar[bool] = False
    runner: ClassVar[None] = None

    def __post_init__(self) -> None:
        rules = {
            "num_speculative_tokens": (_is_int(self.num_speculative_tokens), 1, "an int >= 1"),
            "min_ngram": (_is_int(self.min_ngram), 1, "an int >= 1"),
            "max_ngram": (
                _is_int(self.max_ngram),
                self.min_ngram if _is_int(self.min_ngram) else 1,
                f"an int >= min_ngram ({self.min_ngram!r})",
            ),
        }
        for name, (is_int, lowest, expected) in rules.items():
            value = getattr(self, name)
            if not is_int or value < lowest:
                raise ValueError(f"NgramProposer.{name} must be {expected}, got {value!r}")

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Up to ``num_speculative_tokens`` tokens that followed the most recent earlier
        occurrence of the longest matching suffix; empty when nothing matches."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        # An earlier occurrence must end before the last token, so that one follows it.
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)  # window s is tokens[s : s + n]
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n
                return tokens[follow : follow + self.num_speculative_tokens].tolist()
        return []

    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        matches = [self.match(request.token_ids)[:limit] for request, limit in drafting]
        if not any(matches):
            return {}
        drafts = {}
        for (request, limit), tokens in zip(drafting, matches, strict=True):
            filler = tokens[-1] if tokens else request.token_ids[-1]
            drafts[request.request_id] = Draft(tokens + [filler] * (limit - len(tokens)))
        return drafts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
