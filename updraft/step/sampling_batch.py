"""The sampling parameters of a step's sampling rows, as tensors built on first use."""

from __future__ import annotations

from functools import cached_property

import torch

from updraft.sampling_params import SamplingParams


class SamplingBatch:
    """Per-row sampling parameters, in step order. Per-row tensors are built on first
    use, so an all-greedy step builds none."""

    def __init__(
        self, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> None:
        self.params = params
        self.generators = generators
        sampled = [p for p in params if not p.greedy]
        self.all_greedy = not sampled
        self.use_top_k = any(p.top_k > 0 for p in sampled)
        self.use_top_p = any(p.top_p < 1 for p in sampled)
        self.use_min_p = any(p.min_p > 0 for p in sampled)
        self.want_logprobs = any(p.returns_logprobs for p in params)
        self.num_top_logprobs = max((p.num_top_logprobs for p in params), default=0)

    def __len__(self) -> int:
        return len(self.params)

    @cached_property
    def temperature(self) -> torch.Tensor:  # [B], 0 for greedy rows
        return torch.tensor(
            [0.0 if p.greedy else p.temperature for p in self.params], dtype=torch.float32
        )

    @cached_property
    def top_k(self) -> torch.Tensor:  # [B], 0 for off
        return torch.tensor([max(p.top_k, 0) for p in self.params], dtype=torch.long)

    @cached_property
    def top_p(self) -> torch.Tensor:
        return torch.tensor([p.top_p for p in self.params], dtype=torch.float32)

    @cached_property
    def min_p(self) -> torch.Tensor:
        return torch.tensor([p.min_p for p in self.params], dtype=torch.float32)
