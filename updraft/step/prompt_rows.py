"""The logits rows of a step that score prompt tokens, for requests that asked for
their prompt's logprobs (``SamplingParams.prompt_logprobs``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptRows:
    """Rows after the sampling rows of ``SamplingInputs.logits_indices``, request by
    request: each row's logits predict the prompt token at its position plus one."""

    request_ids: list[str]
    first_positions: list[int]  # per request: the prompt position its first row scores
    counts: list[int]  # per request: its rows
    top: list[int]  # per request: the likeliest tokens it asked for
    targets: torch.Tensor  # [rows] the prompt tokens scored

    def __len__(self) -> int:
        return len(self.targets)
