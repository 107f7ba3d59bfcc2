"""Speculation with an EAGLE-1 head (``speculative_method="eagle"``).

The head (``models/eagle.py``) is a draft head (``speculative/head.py``): its entry i
pairs the token at i + 1 with the target's final hidden state at i and, as EAGLE trains
its heads, turns RoPE at i. Later draft steps chain the head's own output.
"""

from __future__ import annotations

import torch
from torch import nn

from updraft.attention.cache_layout import cache_layout
from updraft.attention.metadata import AttentionMetadata
from updraft.models.eagle import EagleHead, eagle_config, load_eagle_head
from updraft.models.rope import RotaryEmbedding
from updraft.runner.runner import Runner
from updraft.speculative.head import HeadProposer


class EagleModel(nn.Module):
    """The head with the target's embedding and LM head (shared, not copied) and rotary
    tables from the head's own config."""

    def __init__(self, target: nn.Module, head: EagleHead, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
        self.rotary = rotary
        self.head = head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        rotary = self.rotary.lookup(positions, hidden_states.dtype)
        embeds = self.embed_tokens(input_ids)
        return self.head(embeds, hidden_states, rotary, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def eagle_proposer(target: Runner, head_dir: str, num_speculative_tokens: int) -> HeadProposer:
    config = eagle_config(head_dir, target.model_config)
    head = load_eagle_head(head_dir, config, target.dtype, target.device)
    max_positions = target.model.rotary.cos.shape[0]
    with torch.device(target.device):
        rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
    return HeadProposer(
        target,
        EagleModel(target.model, head, rotary),
        cache_layout(config),
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_speculative_tokens=num_speculative_tokens,
    )
