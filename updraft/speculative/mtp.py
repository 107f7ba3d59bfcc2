"""Speculation with DeepSeek's multi-token prediction layer (``speculative_method="mtp"``).

The MTP layer (``models/mtp.py``) is a draft head (``speculative/head.py``): its entry i
pairs the token at i + 1 with the target's final hidden state at i and, as transformers'
``MtpModel`` does, turns RoPE at i + 1. The first MTP layer serves every draft step,
chaining its own normed output.
"""

from __future__ import annotations

import torch
from torch import nn

from updraft.attention.cache_layout import cache_layout
from updraft.attention.metadata import AttentionMetadata
from updraft.models.mtp import MTPLayer, load_mtp_layers
from updraft.runner.runner import Runner
from updraft.speculative.head import HeadProposer


class MTPModel(nn.Module):
    """The layer as a draft head: the target's embedding, rotary tables and LM head
    (shared, not copied) around the MTP layer."""

    def __init__(self, target: nn.Module, layer: MTPLayer) -> None:
        super().__init__()
        self.embed_tokens = target.model.embed_tokens
        self.rotary = target.rotary
        self.lm_head = target.lm_head
        self.layer = layer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        (cache,) = kv_caches
        rotary = self.rotary.lookup(positions + 1, hidden_states.dtype)
        embeds = self.embed_tokens(input_ids)
        return self.layer(embeds, hidden_states, rotary, cache, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def mtp_proposer(target: Runner, model_dir: str, num_speculative_tokens: int) -> HeadProposer:
    config = target.model_config
    layer = load_mtp_layers(config, model_dir, target.dtype, target.device).depths()[0]
    return HeadProposer(
        target,
        MTPModel(target.model, layer),
        cache_layout(config),
        num_layers=1,
        hidden_size=config.hidden_size,
        num_speculative_tokens=num_speculative_tokens,
    )
